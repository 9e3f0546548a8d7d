#!/usr/bin/env bash
# One batched GPU session (device tool, kind nvidia-h200-x2): install the carried
# build, smoke test, pytest -m gpu, compute-sanitizer on the chaos program, benchmark.
# Usage: tools/gpu_check.sh [smoke|tests|sanitize|bench|all]...   (default: all)
# Every step runs under `timeout`: a hung persistent kernel must not hang the call.
set -u
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/dfccl_out}; mkdir -p "$OUT"
PY=${PY:-python3}
steps=${*:-all}
want() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }
log() { echo "=== $* ($(date +%T))"; }

log "machine"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
$PY -c "import jax; print('jax', jax.__version__, jax.devices())"
ls -la jax_dfccl/*.so

if want smoke; then
  log "smoke"; timeout 300 $PY tests/gpu/smoke.py ${SMOKE_ARGS:-} 2>&1 | tee "$OUT/smoke.log"; echo "smoke rc=${PIPESTATUS[0]}"
fi
if want tests; then
  log "pytest -m gpu"; timeout 400 $PY -m pytest -m gpu -x -q tests/gpu -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/pytest.log"
fi
if want sanitize; then
  for tool in memcheck racecheck; do
    log "compute-sanitizer $tool"
    timeout 300 compute-sanitizer --tool $tool --print-limit 20 $PY tests/gpu/chaos_small.py 2>&1 | tail -25 | tee "$OUT/sanitizer_$tool.log"
  done
fi
if want bench; then
  log "benchmark"; timeout ${BENCH_TIMEOUT:-400} $PY benchmarks/collectives.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
fi
log "end"
