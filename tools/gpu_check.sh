#!/usr/bin/env bash
# Every GPU check in one go on a machine with 2+ NVIDIA GPUs, steps in the order given:
#   tools/gpu_check.sh [smoke] [probe] [mover] [crossover] [hang] [bench] [tests] [demo] [sanitize] [testbed] [swap]
#   (default: smoke probe bench tests demo sanitize; a hung smoke stops the rest)
# testbed (one GPU is enough): two processes on it under MPS (tools/mps_testbed.sh): the direct path
#   across processes (mp_worker --case direct), under each of TESTBED_SANITIZERS (default memcheck
#   racecheck synccheck), then TESTBED_RUNS (default 4) times without XLA preallocation (ranges
#   mapped while collectives run: the daemon's relaunch for a newer mapping), then the chains of psums.
# probe: link rates (tools/nvlink_probe.py, needs CuPy) and the small-collective latency breakdown.
# mover: copy-engine chains of MOVER_MIB (default 16,4) MiB: wall and GPU time per collective and the
#   mover's host time to enqueue one (tools/latency_probe.py --large).
# crossover: daemon vs copy-engine per-op time from 1 to 64 MiB (tools/latency_probe.py --crossover).
# hang: tools/mixed_probe.py (the chaos-order workload at 4 MiB with psums on the daemon and
#   all_gathers on the copy engines, with jax_dfccl.pending() reports while it stalls)
#   under lazy and eager module loading; a run alive after 60 s gets its host stacks dumped (cuda-gdb).
# tests: pytest -m gpu tests/gpu (TESTS_K: a -k expression, TESTS_ARGS: more options).
# swap: later steps use the build $ALT_CUDA_SO as _dfccl_cuda (A/B of two builds in one call);
#   their logs and benchmark files get the suffix _alt.
# Run from the repository root with the built extension modules in jax_dfccl/
# (_dfccl_cuda*.so, _dfccl_cpu*.so) or with the package installed.
# Every step runs under `timeout` (a hung persistent kernel must not hang the run);
# logs and benchmark JSON/markdown go to $OUT.
set -u
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
export TF_CPP_MIN_LOG_LEVEL=2
OUT=${OUT:-/tmp/dfccl_out}; mkdir -p "$OUT"
PY=${PY:-python3}
steps=${*:-smoke probe bench tests demo sanitize}
SFX=""  # _alt after a swap
log() { echo "=== $* ($(date +%T))"; }

log "machine"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
for step in $steps; do
  case $step in
    smoke)
      log smoke
      timeout ${SMOKE_TIMEOUT:-120} $PY tests/gpu/smoke.py ${SMOKE_ARGS:---quick} > "$OUT/smoke.log" 2>&1
      rc=$?; grep -v "^W0000\|^I0000\|UserWarning\|return lax_numpy\|x = jnp.asarray" "$OUT/smoke.log" | tail -40
      echo "smoke rc=$rc"; [[ $rc != 124 ]] || { log "smoke hung: stopping"; exit 1; } ;;
    probe)
      log probe
      timeout ${PROBE_TIMEOUT:-90} $PY tools/nvlink_probe.py > "$OUT/nvlink_probe.log" 2>&1; echo "nvlink probe rc=$?"
      for b in ${PROBE_BYTES:-4096 65536 --bw}; do timeout 150 $PY tools/latency_probe.py $b >> "$OUT/latency_probe$SFX.log" 2>&1; done
      echo "latency probe rc=$?"; grep -v "^W0000\|^I0000" "$OUT/nvlink_probe.log" "$OUT/latency_probe$SFX.log" | tail -30 ;;
    mover)
      log "copy-engine chains (mover host time and GPU time per collective)"
      timeout ${MOVER_TIMEOUT:-120} $PY tools/latency_probe.py --large ${MOVER_MIB:-16,4} > "$OUT/mover$SFX.log" 2>&1
      echo "mover probe rc=$?"; grep -v "^W0000\|^I0000" "$OUT/mover$SFX.log" | tail -8 ;;
    crossover)
      log crossover
      timeout ${CROSS_TIMEOUT:-200} $PY tools/latency_probe.py --crossover > "$OUT/crossover.log" 2>&1
      echo "crossover rc=$?"; grep -v "^W0000\|^I0000" "$OUT/crossover.log" | tail -22 ;;
    hang)
      # tools/mixed_probe.py under each CUDA_MODULE_LOADING; a run alive after 60 s gets
      # its host threads' stacks dumped (cuda-gdb attaches) and is killed.
      for ml in ${HANG_LOADING:-LAZY EAGER}; do
        log "mixed probe, CUDA_MODULE_LOADING=$ml"
        CUDA_MODULE_LOADING=$ml $PY tools/mixed_probe.py ${HANG_ARGS:-} > "$OUT/mixed_probe_$ml.log" 2>&1 & pid=$!
        for _ in $(seq 1 ${HANG_WAIT:-60}); do sleep 1; kill -0 $pid 2>/dev/null || break; done
        if kill -0 $pid 2>/dev/null; then
          echo "still running after ${HANG_WAIT:-60} s: host stacks to $OUT/mixed_gdb_$ml.log"
          timeout 90 cuda-gdb -p $pid -batch -ex "info threads" -ex "thread apply all bt 24" > "$OUT/mixed_gdb_$ml.log" 2>&1
          kill -9 $pid; wait $pid 2>/dev/null
        fi
        grep -v "^W0000\|^I0000" "$OUT/mixed_probe_$ml.log" | tail -30 | cut -c1-400
      done ;;
    swap)
      # A/B of two builds in one call: the steps after `swap` use $ALT_CUDA_SO as _dfccl_cuda.
      log "swap: _dfccl_cuda <- ${ALT_CUDA_SO:?set ALT_CUDA_SO}"
      cp "$ALT_CUDA_SO" jax_dfccl/_dfccl_cuda.cpython-312-x86_64-linux-gnu.so; SFX=_alt ;;
    bench)
      log benchmark
      timeout ${BENCH_TIMEOUT:-360} $PY benchmarks/collectives.py --out "$OUT" ${BENCH_ARGS:-} ${SFX:+--tag h200x2$SFX} \
        > "$OUT/bench$SFX.log" 2>&1
      echo "bench rc=$?"; grep -v "^W0000\|^I0000" "$OUT/bench$SFX.log" | tail -45 ;;
    tests)
      log "pytest -m gpu"
      to=""; $PY -c "import pytest_timeout" 2>/dev/null && to="--timeout 90"
      timeout ${TESTS_TIMEOUT:-200} $PY -m pytest -m gpu -q tests/gpu -p no:cacheprovider $to \
        ${TESTS_ARGS:-} ${TESTS_K:+-k "$TESTS_K"} > "$OUT/pytest$SFX.log" 2>&1
      echo "pytest rc=$?"; tail -25 "$OUT/pytest$SFX.log" ;;
    demo)
      log "python -m jax_dfccl.demo"
      timeout ${DEMO_TIMEOUT:-150} $PY -m jax_dfccl.demo > "$OUT/demo.log" 2>&1
      echo "demo rc=$?"; grep -v "^W0000\|^I0000" "$OUT/demo.log" | tail -12 ;;
    testbed)
      # (Two processes share the GPU: each takes a fifth of its memory, not the fraction above.)
      tb() { XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 tools/mps_testbed.sh -n 2 --tail 0 "$@"; }
      W="$PY tests/gpu/mp_worker.py --case direct"
      res() { grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$1"/rank*.log; grep -h "^RESULT" "$1"/rank*.log | cut -c1-160; }
      log "testbed: direct case"; tb --timeout 90 --out "$OUT/tb_direct" -- $W > "$OUT/tb_direct.log" 2>&1
      echo "direct rc=$?"; res "$OUT/tb_direct"
      for tool in ${TESTBED_SANITIZERS:-memcheck racecheck synccheck}; do
        log "testbed: compute-sanitizer $tool"
        tb --timeout 180 --out "$OUT/tb_$tool" -- compute-sanitizer --tool $tool --print-limit 4 --error-exitcode 9 $W \
          > "$OUT/tb_$tool.log" 2>&1
        echo "$tool rc=$?"; res "$OUT/tb_$tool"
      done
      for i in $(seq 1 ${TESTBED_RUNS:-4}); do
        log "testbed: direct case without preallocation ($i)"
        XLA_PYTHON_CLIENT_PREALLOCATE=false tb --timeout 60 --out "$OUT/tb_noprealloc$i" -- $W --watch 5 \
          > "$OUT/tb_noprealloc$i.log" 2>&1
        echo "no preallocation rc=$?"; res "$OUT/tb_noprealloc$i"
      done
      log "testbed: chains of psums"
      tb --timeout 150 --out "$OUT/tb_bench" -- $PY tests/gpu/mp_worker.py --case bench --sizes 4096,1048576,16777216 \
        > "$OUT/tb_bench.log" 2>&1
      echo "chains rc=$?"; grep -h "^RESULT" "$OUT/tb_bench/rank0.log" | cut -c1-900 ;;
    sanitize)
      for tool in ${SANITIZERS:-memcheck racecheck}; do
        log "compute-sanitizer $tool"
        timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --print-limit 20 $PY tests/gpu/chaos_small.py ${SAN_ARGS:-} \
          > "$OUT/sanitizer_$tool.log" 2>&1
        echo "$tool rc=$?"; grep -v "^W0000\|^I0000" "$OUT/sanitizer_$tool.log" | tail -12
      done ;;
  esac
done
log end
