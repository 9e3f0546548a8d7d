#!/usr/bin/env bash
# GPU check of the fused overlap kernels (_dfccl_overlap) on a machine with 2+
# NVIDIA GPUs (sm90), from the repository root with the built modules in
# jax_dfccl/.  Logs and benchmark JSON/markdown go to $OUT.  Whole run < 6 min:
#   1. pytest -m gpu tests/gpu/test_overlap_gpu.py          (timeout 200 s)
#   1b. benchmarks/overlap_diag.py: fused kernel time vs its GEMM alone (no_comm)
#      vs XLA's dot, push kernel time                        (timeout <= 100 s)
#   2. benchmark, LLaMA TP=2 shapes (AG M in {1024,4096}, (N,K)=(14336,4096);
#      RS M in {1024,4096}, (N,K)=(4096,14336); global sizes), fused kernel side
#      by side with the GEMM alone, sequential GEMM + collective, XLA and the
#      jax.lax-collective schedule, and the fused kernel under the previous
#      scheme (fused_legacy) and with the RS copy engine (fused_rsce) (timeout <= 200 s)
#   3. compute-sanitizer memcheck on a tiny fused-op program, if time is left
#      (timeout <= 120 s).  If the sanitizer serializes kernels, the ranks'
#      kernels cannot meet: expect the bounded-wait timeout message then (not a hang).
# OVERLAP_STEPS (default tests,diag,bench,memcheck) picks the steps.  The fused
# kernels' settings come from jax_dfccl.config (overlap_fused,
# overlap_wait_timeout_s), not from environment variables.
set -u
STEPS=${OVERLAP_STEPS:-tests,diag,bench,memcheck}
step() { [[ ",$STEPS," == *",$1,"* ]]; }
T0=$SECONDS
BUDGET=${OVERLAP_BUDGET_S:-340}
left() { echo $(( BUDGET - (SECONDS - T0) )); }
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} TF_CPP_MIN_LOG_LEVEL=2
OUT=${OUT:-/tmp/dfccl_out}; mkdir -p "$OUT"
PY=${PY:-python3}
log() { echo "=== $* ($(date +%T), $(( SECONDS - T0 )) s)"; }
filt() { grep -v "^W0000\|^I0000\|UserWarning\|warnings.warn"; }

log machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
ls -la jax_dfccl/*.so
$PY -c "import jax, jax_dfccl._src.overlap_gpu as g; print('jax', jax.__version__, jax.devices()); print('fused module available:', g.available())" 2>&1 | filt | tail -3

if step tests; then
  log "pytest -m gpu tests/gpu/test_overlap_gpu.py"
  timeout 200 $PY -m pytest -m gpu -q tests/gpu/test_overlap_gpu.py -p no:cacheprovider -rfE \
    > "$OUT/overlap_tests.log" 2>&1
  echo "tests rc=$?"; filt < "$OUT/overlap_tests.log" | tail -60
fi

dt=$(( $(left) - 60 )); (( dt > 100 )) && dt=100
if step diag && (( dt >= 30 )); then
  log "diagnostic (timeout $dt s)"
  timeout $dt $PY benchmarks/overlap_diag.py --m 1024,4096 --out "$OUT/overlap_diag.jsonl" \
    > "$OUT/overlap_diag.log" 2>&1
  echo "diag rc=$?"; filt < "$OUT/overlap_diag.log" | tail -8
fi

bt=$(( $(left) - 40 )); (( bt > 200 )) && bt=200
if step bench && (( bt >= 30 )); then
  log "benchmark (timeout $bt s)"
  timeout $bt $PY benchmarks/overlap.py --m 1024,4096 --ops ag,rs --limit 4 --no-windowed \
    --variants ${OVERLAP_VARIANTS:-t_gemm,xla_plain,ours_fused,fused_legacy,fused_rsce} --iters 5 --reps 3 \
    --tag h200x2_fused --outdir "$OUT" > "$OUT/overlap_bench.log" 2>&1
  echo "bench rc=$?"; filt < "$OUT/overlap_bench.log" | tail -30
  cat "$OUT"/overlap_*h200x2_fused*.md 2>/dev/null | tail -20
else
  log "benchmark skipped (no time left)"
fi

mt=$(( $(left) - 5 )); (( mt > 120 )) && mt=120
if step memcheck && (( mt >= 45 )) && command -v compute-sanitizer >/dev/null; then
  log "compute-sanitizer memcheck (timeout $mt s)"
  cat > "$OUT/overlap_memcheck.py" <<'PYEOF'
import numpy as np, jax, jax.numpy as jnp, jax_dfccl
jax_dfccl.configure(overlap_wait_timeout_s=3.0)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax_dfccl._src import overlap as ov, overlap_gpu as og
mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
x = jnp.ones((136, 72), jnp.bfloat16); w = jnp.ones((72, 40), jnp.bfloat16)
for name, op, xs, ws, os_ in (("ag", ov.all_gather_matmul, P("tp"), P(None, "tp"), P(None, "tp")),
                              ("rs", ov.matmul_reduce_scatter, P(None, "tp"), P("tp"), P("tp"))):
  f = jax.jit(jax.shard_map(lambda x, w: op(x, w, "tp"), mesh=mesh, in_specs=(xs, ws), out_specs=os_))
  y = np.asarray(f(put(x, xs), put(w, ws)).astype(jnp.float32))
  print(name, y.shape, "max", y.max(), "min", y.min(), "errors:", og.errors(), flush=True)
PYEOF
  XLA_PYTHON_CLIENT_PREALLOCATE=false \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    timeout $mt compute-sanitizer --tool memcheck --print-limit 20 $PY "$OUT/overlap_memcheck.py" \
    > "$OUT/overlap_memcheck.log" 2>&1
  echo "memcheck rc=$?"; filt < "$OUT/overlap_memcheck.log" | grep -v "^=========  *Host Frame\|^=========     " | tail -30
else
  log "memcheck skipped (no time left or no compute-sanitizer)"
fi
log done
