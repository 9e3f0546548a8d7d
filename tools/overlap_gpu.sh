#!/usr/bin/env bash
# GPU check of the fused overlap kernels (in _dfccl_cuda) on a machine with 2
# NVIDIA GPUs (sm90; the `gemm` step needs one), from the repository root with
# the built modules in jax_dfccl/.  Everything goes to $OUT; the whole run stays within
# OVERLAP_BUDGET_S (default 470 s), every step under `timeout`:
#   tests     pytest -m gpu tests/gpu/test_overlap_gpu.py            (timeout 120 s)
#   timeline  benchmarks/overlap_diag.py on AG 1024x14336x4096 and RS 1024x4096x14336
#             (variants fused, mailbox, nocomm, legacy, rs_ce): per-variant wall /
#             kernel / copy / host times -> overlap_<date>_<tag>_diag.jsonl, and the
#             whole per-tile device timelines of fused, mailbox and nocomm ->
#             overlap_timeline_<date>_<tag>.json (notebooks/03_overlap.ipynb)  (timeout 100 s);
#             then RS 4096x4096x14336: fused (copy engine), rs_sm, mailbox  (timeout 40 s)
#   bench     benchmarks/overlap.py, every listed shape (AG and RS, M in
#             {1024, 4096, 8192}, three (N, K) pairs), XLA windowed einsum in a
#             child process, within the time left (at most 330 s)
#             -> overlap_<date>_<tag>.{json,md}
#   gemm      (one GPU; only if listed in OVERLAP_STEPS) pytest -m gpu tests/gpu/test_overlap_gemm.py,
#             then benchmarks/overlap_gemm.py (the fused GEMM alone, 1x1 and 2x1 clusters, vs XLA's
#             dot; OVERLAP_GEMM_ARGS) -> overlap_gemm_<date>_<tag>.{json,md}
#   memcheck  (only if listed in OVERLAP_STEPS) compute-sanitizer of a tiny fused-op program
#             (one GPU: the one-rank GEMM, both cluster shapes, two split last waves), one run per tool in
#             OVERLAP_SANITIZERS (default memcheck; also racecheck, synccheck), each within the
#             time left (at most OVERLAP_SAN_S, default 120 s)
#   sanitize  (one GPU; only if listed in OVERLAP_STEPS) compute-sanitizer over the fused GEMM's own GPU
#             tests, the largest case of every variant (OVERLAP_SAN_K, default: 1300x3600x704, the 2x1
#             clusters the plan picks, variants alternating on one channel), one run per tool in
#             OVERLAP_SAN_TOOLS (default synccheck racecheck), each within the time left (at most
#             OVERLAP_SAN_TESTS_S, default 330 s); XLA's autotuning off, so that the tests' f32 reference
#             dot is not autotuned under the tool (racecheck of the autotuner's candidates took minutes)
# OVERLAP_STEPS (default tests,timeline,bench) picks the steps, OVERLAP_TAG (default
# h200x2) names the results.  The kernels' settings come from jax_dfccl.config.
set -u
STEPS=${OVERLAP_STEPS:-tests,timeline,bench}
step() { [[ ",$STEPS," == *",$1,"* ]]; }
T0=$SECONDS
BUDGET=${OVERLAP_BUDGET_S:-470}
TAG=${OVERLAP_TAG:-h200x2}
DATE=$(date +%F)  # the date in the result names (local, as the scripts use)
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
timeout 60 $PY -c "import jax, jax_dfccl._src.overlap_gpu as g; print('jax', jax.__version__, jax.devices()); print('fused module available:', g.available())" 2>&1 | filt | tail -3

gpu_tests() {  # name, test file, timeout (s)
  log "pytest -m gpu $2 (timeout $3 s)"
  timeout $3 $PY -m pytest -m gpu -q "$2" -p no:cacheprovider -rfE > "$OUT/$1.log" 2>&1
  echo "$1 rc=$?"; filt < "$OUT/$1.log" | tail -40
}

if step gemm; then
  gpu_tests overlap_gemm_tests tests/gpu/test_overlap_gemm.py 150
  gt=$(( $(left) - 30 )); (( gt > 240 )) && gt=240
  log "benchmarks/overlap_gemm.py (timeout $gt s)"
  timeout $gt $PY benchmarks/overlap_gemm.py --tag "$TAG" --outdir "$OUT" ${OVERLAP_GEMM_ARGS:-} \
    > "$OUT/overlap_gemm_bench.log" 2>&1
  echo "gemm bench rc=$?"; filt < "$OUT/overlap_gemm_bench.log" | grep -v '^{' | tail -30
fi

if step tests; then
  gpu_tests overlap_tests tests/gpu/test_overlap_gpu.py 120
fi

tt=$(( $(left) - 200 )); (( tt > 100 )) && tt=100
if step timeline && (( tt >= 40 )); then
  log "timeline + diagnostic (timeout $tt s)"
  timeout $tt $PY benchmarks/overlap_diag.py --shapes ag:1024:14336:4096,rs:1024:4096:14336 \
    --variants fused,mailbox,nocomm,legacy,rs_ce --iters 4 \
    --out "$OUT/overlap_${DATE}_${TAG}_diag.jsonl" --timeline "$OUT/overlap_timeline_${DATE}_${TAG}.json" \
    > "$OUT/overlap_diag.log" 2>&1
  echo "timeline rc=$?"; filt < "$OUT/overlap_diag.log" | tail -4 | cut -c1-1500
  ls -la "$OUT"/overlap_timeline_*.json 2>/dev/null
  dt=$(( $(left) - 260 )); (( dt > 40 )) && dt=40
  if (( dt >= 20 )); then  # RS with 16 MiB blocks: copy engine (default) against epilogue stores
    timeout $dt $PY benchmarks/overlap_diag.py --shapes rs:4096:4096:14336 --variants fused,rs_sm,mailbox \
      --iters 4 --out "$OUT/overlap_${DATE}_${TAG}_diag.jsonl" >> "$OUT/overlap_diag.log" 2>&1
    echo "diag rs 4096 rc=$?"; filt < "$OUT/overlap_diag.log" | tail -1 | cut -c1-1500
  fi
else
  log "timeline skipped (no time left)"
fi

bb=$(( $(left) - 40 )); (( bb > 330 )) && bb=330
if step bench && (( bb >= 60 )); then
  log "benchmark, all shapes (budget $bb s)"
  timeout $(( bb + 30 )) $PY benchmarks/overlap.py --budget-s $bb --tag "$TAG" --outdir "$OUT" \
    ${OVERLAP_BENCH_ARGS:-} > "$OUT/overlap_bench.log" 2>&1
  echo "bench rc=$?"; filt < "$OUT/overlap_bench.log" | grep -v '^{"shape"' | tail -10
  cat "$OUT/overlap_${DATE}_${TAG}.md" 2>/dev/null | tail -30
else
  log "benchmark skipped (no time left)"
fi

mt=$(( $(left) - 5 )); (( mt > ${OVERLAP_SAN_S:-120} )) && mt=${OVERLAP_SAN_S:-120}
if step memcheck && (( mt >= 45 )) && command -v compute-sanitizer >/dev/null; then
  cat > "$OUT/overlap_memcheck.py" <<'PYEOF'
import numpy as np, jax, jax.numpy as jnp, jax_dfccl
jax_dfccl.configure(overlap_wait_timeout_s=3.0)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax_dfccl._src import overlap as ov, overlap_gpu as og
x = jnp.ones((136, 72), jnp.bfloat16); w = jnp.ones((72, 40), jnp.bfloat16)
if len(jax.devices()) < 2:  # one GPU: the GEMM alone (a one-rank group), 1x1 and 2x1 clusters
  mesh = Mesh(np.array(jax.devices()[:1]), ("one",))
  x = jnp.ones((392, 72), jnp.bfloat16)  # 4 m tiles: the 2x1 variant's last pair is whole
  w = jnp.ones((72, 200), jnp.bfloat16)  # 200 columns: a partial last tile column at every width
  for cm, tn in ((1, 256), (2, 256), (1, 128), (2, 192)):
    jax_dfccl.configure(overlap_cluster_m=cm, overlap_tile_n=tn)
    for name, op in (("ag", lambda x, w: og.all_gather_matmul(x, w, "one", 1)[0]),
                     ("rs", lambda x, w: og.matmul_reduce_scatter(x, w, "one", 1))):
      for rows in (392, 264):  # 264: 3 m tiles, the last pair's second tile below the matrix
        f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
        y = np.asarray(f(x[:rows], w).astype(jnp.float32))
        print(name, "cluster", cm, "tile_n", tn, y.shape, "all", 72, bool((y == 72).all()), "errors:", og.errors(),
              flush=True)
  # split last wave (132 SMs): 25 tiles in 4 chunks; 132 + 33 in 2 (at 256 columns; other counts at 128, 192)
  for tn in (0, 128, 192):
    jax_dfccl.configure(overlap_cluster_m=1, overlap_tile_n=tn)
    for (m, n, k) in ((600, 1040, 1000), (1300, 3600, 512)):
      for name, op in (("ag", lambda x, w: og.all_gather_matmul(x, w, "one", 1)[0]),
                       ("rs", lambda x, w: og.matmul_reduce_scatter(x, w, "one", 1))):
        f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
        for _ in range(2):  # the second instance: flags from the first still there
          y = np.asarray(f(jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16)).astype(jnp.float32))
        print(name, "split", "tile_n", tn, y.shape, "all", k, bool((y == k).all()), "errors:", og.errors(), flush=True)
  raise SystemExit(0)
mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
for name, op, xs, ws, os_ in (("ag", ov.all_gather_matmul, P("tp"), P(None, "tp"), P(None, "tp")),
                              ("rs", ov.matmul_reduce_scatter, P(None, "tp"), P("tp"), P("tp"))):
  f = jax.jit(jax.shard_map(lambda x, w: op(x, w, "tp"), mesh=mesh, in_specs=(xs, ws), out_specs=os_))
  for _ in range(3):  # from the second call on: addresses from the host, announcements in device memory
    y = np.asarray(f(put(x, xs), put(w, ws)).astype(jnp.float32))
  print(name, y.shape, "max", y.max(), "min", y.min(), "errors:", og.errors(), flush=True)
PYEOF
  for tool in ${OVERLAP_SANITIZERS:-memcheck}; do
    mt=$(( $(left) - 5 )); (( mt > ${OVERLAP_SAN_S:-120} )) && mt=${OVERLAP_SAN_S:-120}; (( mt >= 45 )) || break
    log "compute-sanitizer $tool (timeout $mt s)"
    XLA_PYTHON_CLIENT_PREALLOCATE=false \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
      timeout $mt compute-sanitizer --tool $tool --print-limit 20 $PY "$OUT/overlap_memcheck.py" \
      > "$OUT/overlap_$tool.log" 2>&1
    echo "$tool rc=$?"; filt < "$OUT/overlap_$tool.log" | grep -v "^=========  *Host Frame\|^=========     " | tail -30
  done
fi

if step sanitize && command -v compute-sanitizer >/dev/null; then
  for tool in ${OVERLAP_SAN_TOOLS:-synccheck racecheck}; do
    st=$(( $(left) - 5 )); (( st > ${OVERLAP_SAN_TESTS_S:-330} )) && st=${OVERLAP_SAN_TESTS_S:-330}; (( st >= 60 )) || break
    log "compute-sanitizer $tool over the GEMM tests (timeout $st s)"
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
      timeout $st compute-sanitizer --tool $tool --print-limit 20 $PY -m pytest -m gpu -v -p no:cacheprovider \
      tests/gpu/test_overlap_gemm.py -k "${OVERLAP_SAN_K:-1300-3600-704 or test_auto_cluster or alternate}" \
      > "$OUT/overlap_tests_$tool.log" 2>&1
    echo "$tool rc=$? ($(grep -c PASSED "$OUT/overlap_tests_$tool.log") passed)"
    grep "SUMMARY\|FAILED\|hazard\|Error" "$OUT/overlap_tests_$tool.log" | grep -v "^=========  *Host Frame" | tail -12
  done
fi

log done
