#!/usr/bin/env bash
# The failure probes of issue 46 and the figures it keeps, in one go on one GPU (a device call):
#   tools/testbed_failures.sh [abandon] [retry] [retry_cmdbuf] [chaos] [chain] [forced] [gemm] [memcheck]
#   (default: all eight, in this order, within FAIL_BUDGET_S seconds, default 480: a step that no
#   longer fits its minimum is skipped and says so)
# abandon: two processes on the GPU under MPS (tools/mps_testbed.sh): rank 0's program fails between
#   a start and its done, rank 0 refills buffers of the output's size with a sentinel, rank 1 starts
#   the instance later (tests/gpu/mp_worker.py --case abandon; ABANDON_ARGS, default all_gather and
#   psum at 4 KiB, 1 MiB and 4 MiB per rank, 3 runs each): rank 0's touched sentinel buffers, rank
#   1's exactness.
# retry: rank 0's program fails before a psum rank 1 started; rank 0 runs again with 103, rank 1
#   runs with 1 then 2 (mp_worker.py --case retry), outside XLA's command buffers.
# retry_cmdbuf: the same inside them, after a warm run (--warm 1; the psum alone forms a command
#   buffer): the retry replays the recorded psum; rank 1's failed run traps its context.
# chaos: random failures before or after a psum on both ranks, 24 runs, outside command buffers
#   (mp_worker.py --case chaos_retry): no run may return another run's sum.
# chain: the testbed's chain of 4 KiB psums (mp_worker.py --case bench --sizes 4096 CHAIN_ARGS, e.g. --profile).
# forced: the forced one-GPU chain (benchmarks/collectives.py, a group of one through the runtime).
# gemm: the fused GEMM alone against XLA's dot (benchmarks/overlap_gemm.py, GEMM_ARGS).
# memcheck: the abandon case under compute-sanitizer memcheck (MEMCHECK_ARGS: fewer sizes and runs).
# abandon, retry, retry_cmdbuf, chaos and memcheck pass (status 0) once nothing of an abandoned
# program is touched and rank 1 is exact, once rank 1's retry run fails and no run returns another
# run's values (outside command buffers: both next runs return 105).
# Not here: the copy-engine path, which needs two GPUs in one process (across processes the
# daemon's direct path moves every size: runtime.cc UsesCopyEngine).
# Run from the repository root with the built modules in jax_dfccl/ (TB_FLAGS: more options of
# tools/mps_testbed.sh, e.g. --no-mps).  Every step runs under
# `timeout`; logs and the benchmarks' files go to $OUT/logs, and at the end $OUT holds
# failures_summary.json (every RESULT line, per step and rank, with each step's status and
# seconds), logs.tgz (every log), and the benchmarks' own json/md.
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} TF_CPP_MIN_LOG_LEVEL=2
OUT=${OUT:-/tmp/dfccl_failures}; LOGS=$OUT/logs; mkdir -p "$LOGS"
PY=${PY:-python3}
BUDGET=${FAIL_BUDGET_S:-480}
steps=${*:-abandon retry retry_cmdbuf chaos chain forced gemm memcheck}
T0=$SECONDS
STEPS_TSV=$LOGS/steps.tsv; : > "$STEPS_TSV"   # step, status, seconds, folder of rank logs (or -)
log() { echo "=== $* ($(date +%T), $((SECONDS - T0)) s of $BUDGET)"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
# fits MIN WANT: prints the step's limit (WANT, or what is left), or fails when less than MIN is left
fits() { local l; l=$(left); (( l >= $1 )) || return 1; (( l < $2 )) && echo "$l" || echo "$2"; }
record() { echo -e "$1\t$2\t$3\t$4" >> "$STEPS_TSV"; }
tb() {  # tb NAME LIMIT [ENV=VALUE...] -- CMD...: the testbed, two processes, rank logs in $LOGS/NAME
  local name=$1 lim=$2; shift 2
  local envs=(); while [[ $1 != -- ]]; do envs+=("$1"); shift; done; shift
  local t=$SECONDS
  env XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 "${envs[@]}" timeout $((lim + 30)) tools/mps_testbed.sh -n 2 --tail 0 \
    ${TB_FLAGS:-} --keep-going --timeout "$lim" --out "$LOGS/$name" -- "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  record "$name" "$rc" $((SECONDS - t)) "$name"
  echo "$name rc=$rc ($((SECONDS - t)) s)"; tail -3 "$LOGS/$name.log"
  grep -h "ERROR SUMMARY" "$LOGS/$name"/rank*.log 2>/dev/null
  grep -h "^PROBE\|^RUN" "$LOGS/$name"/rank*.log 2>/dev/null | cut -c1-260
  grep -h "^RESULT" "$LOGS/$name"/rank*.log 2>/dev/null | cut -c1-400
}
skip() { log "$1: skipped (budget: $(left) s left)"; record "$1" skipped 0 -; }

log machine
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
compute-sanitizer --version 2>/dev/null | tail -1
W="$PY tests/gpu/mp_worker.py"
for step in $steps; do
  case $step in
    abandon)
      lim=$(fits 60 200) || { skip abandon; continue; }
      log "abandon: rank 0's program fails between a start and its done"
      tb abandon "$lim" -- $W --case abandon ${ABANDON_ARGS:-} ;;
    retry)
      lim=$(fits 40 90) || { skip retry; continue; }
      log "retry: rank 0's program fails before a start rank 1 made"
      tb retry "$lim" XLA_FLAGS=--xla_gpu_enable_command_buffer= -- $W --case retry ${RETRY_ARGS:-} ;;
    retry_cmdbuf)
      lim=$(fits 40 90) || { skip retry_cmdbuf; continue; }
      log "retry_cmdbuf: the same inside command buffers, after a warm run"
      tb retry_cmdbuf "$lim" XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 -- $W --case retry --warm 1 ${RETRY_ARGS:-} ;;
    chaos)
      lim=$(fits 60 150) || { skip chaos; continue; }
      log "chaos: random failures before or after a psum on both ranks"
      tb chaos "$lim" XLA_FLAGS=--xla_gpu_enable_command_buffer= -- $W --case chaos_retry --timeout-s 3 ${CHAOS_ARGS:-} ;;
    chain)
      lim=$(fits 60 150) || { skip chain; continue; }
      log "chain: 4 KiB psums across the two processes"
      tb chain "$lim" -- $W --case bench --sizes 4096 ${CHAIN_ARGS:-} ;;
    forced)
      lim=$(fits 60 150) || { skip forced; continue; }
      log "forced one-GPU chain"
      t=$SECONDS
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout "$lim" $PY benchmarks/collectives.py --sizes 4K --reps 5 --no-chaos \
        --stall-report 0 --config runtime_for_groups_of_one=1,submit_inline_us=20,small_by_identity=1 --pipelined \
        --tag ${FORCED_TAG:-h200_one_gpu_forced_before46} --out "$LOGS" > "$LOGS/forced.log" 2>&1
      rc=$?; record forced "$rc" $((SECONDS - t)) -
      echo "forced rc=$rc ($((SECONDS - t)) s)"; grep -v "^W0000\|^I0000" "$LOGS/forced.log" | tail -8 ;;
    gemm)
      lim=$(fits 60 150) || { skip gemm; continue; }
      log "fused GEMM alone against XLA's dot"
      t=$SECONDS
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout "$lim" $PY benchmarks/overlap_gemm.py --tag ${GEMM_TAG:-h200_before46} \
        ${GEMM_ARGS:---m 1024,4096 --variants xla_dot,fused_1x1 --reps 3} --outdir "$LOGS" > "$LOGS/gemm.log" 2>&1
      rc=$?; record gemm "$rc" $((SECONDS - t)) -
      echo "gemm rc=$rc ($((SECONDS - t)) s)"; grep "^|" "$LOGS/gemm.log" | head -18 ;;
    memcheck)
      lim=$(fits 100 240) || { skip memcheck; continue; }
      log "abandon under compute-sanitizer memcheck"
      tb memcheck "$lim" -- compute-sanitizer --tool memcheck --print-limit 8 --error-exitcode 9 \
        $W --case abandon ${MEMCHECK_ARGS:---ops all_gather,psum --sizes 4096,1048576 --runs 1 --timeout-s 30} ;;
    *) log "unknown step '$step'"; record "$step" unknown 0 - ;;
  esac
done
log "summary"
$PY - "$LOGS" "$OUT/failures_summary.json" <<'EOF'
import json, pathlib, sys
logs, dest = pathlib.Path(sys.argv[1]), sys.argv[2]
summary = {"steps": {}}
for line in (logs / "steps.tsv").read_text().splitlines():
  name, status, seconds, folder = line.split("\t")
  step = {"status": status, "seconds": int(seconds)}
  if folder != "-":
    for rank_log in sorted((logs / folder).glob("rank*.log")):
      text = rank_log.read_text(errors="replace")
      res = [l[7:] for l in text.splitlines() if l.startswith("RESULT ")]
      probes = [json.loads(l.split(" ", 1)[1]) for l in text.splitlines() if l.startswith(("PROBE ", "RUN "))]
      sans = [l for l in text.splitlines() if "ERROR SUMMARY" in l]
      step[rank_log.stem] = json.loads(res[-1]) if res else {"no_result": True, "probe_lines": probes,
                                                              "tail": text[-1500:]}
      if sans:
        step[rank_log.stem]["sanitizer"] = sans[-1]
  summary["steps"][name] = step
for kind in ("collectives_", "overlap_gemm_"):
  for f in sorted(logs.glob(kind + "*.json")):
    summary.setdefault("files", []).append(f.name)
json.dump(summary, open(dest, "w"), indent=1)
for name, step in summary["steps"].items():
  print(name, step["status"], f'{step["seconds"]} s')
EOF
cp "$LOGS"/collectives_*.json "$LOGS"/collectives_*.md "$LOGS"/overlap_gemm_*.json "$LOGS"/overlap_gemm_*.md "$OUT"/ 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
ls -la "$OUT"
log end
