#!/usr/bin/env bash
# One device call, from the repository root, OUT set: this tree (its modules in NEW_SO, default
# .carry/d4) against a previous build (BASE: a tree of that version with its modules in jax_dfccl/,
# default .carry/base). In order of need: the abandoned-program probe and the retry scenario
# (tools/testbed_failures.sh), the kept figures of both builds interleaved, start/done against
# blocking (mp_worker.py --case bench_async), the one-GPU suites.
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
R=$PWD; L=$OUT/log.txt; : > $L
BASE=$(cd ${BASE:-.carry/base} && pwd); NEW_SO=${NEW_SO:-.carry/d4}  # a built tree of the previous version; this one's modules
BUDGET=${BUDGET:-575}
log() { echo "=== $(date +%T) [$SECONDS s] $*" | tee -a $L; }
left() { [ $((SECONDS + $1)) -lt $BUDGET ]; }
cp $NEW_SO/*.so jax_dfccl/
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee -a $L
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE 'H[0-9]+' | tr 'A-Z' 'a-z')  # tags the files
python3 -c "import jax; print('jax', jax.__version__)" 2>&1 | tail -1 | tee -a $L
log "failures (new build): abandon retry"
OUT=$OUT/failures FAIL_BUDGET_S=150 PYTHONPATH=$R bash tools/testbed_failures.sh abandon retry > $OUT/failures.log 2>&1
grep -h "rc=\|^PROBE\|^RUN" $OUT/failures.log | cut -c1-260 | tee -a $L
keep() {  # $1: base|new, $2: step
  local dir=$R tag=after46; [ $1 = base ] && dir=$BASE && tag=before46b
  log "keep $2 ($1)"
  (cd $dir && OUT=$OUT/keep_$1_$2 FAIL_BUDGET_S=120 FORCED_TAG=${CARD:-gpu}_one_gpu_forced_$tag GEMM_TAG=${CARD:-gpu}_$tag \
     PYTHONPATH=$dir bash tools/testbed_failures.sh $2 > $OUT/keep_$1_$2.log 2>&1)
  grep -h "rc=\|^|" $OUT/keep_$1_$2.log | cut -c1-300 | head -20 | tee -a $L
  grep -ho '"[a-z_]*donated_us": [0-9.]*' $OUT/keep_$1_$2/logs/chain/rank*.log 2>/dev/null | tr '\n' ' ' | tee -a $L; echo | tee -a $L
}
for step in chain forced gemm; do
  left 90 && keep base $step
  left 90 && keep new $step
done
bench() {  # $1: package root, $2: name
  log "bench_async $2"
  PYTHONPATH=$1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout 130 tools/mps_testbed.sh -n 2 --tail 0 --timeout 110 \
    --out $OUT/ba_$2 -- python3 tests/gpu/mp_worker.py --case bench_async --sizes 4096,1048576,4194304 > $OUT/ba_$2.log 2>&1
  echo "bench_async $2 rc=$?" | tee -a $L
  grep -h "^ROW" $OUT/ba_$2/rank*.log | sed "s/^/$2 /" | tee -a $L
  grep -h "^RESULT" $OUT/ba_$2/rank*.log | grep -o '"ok": [a-z]*' | tr '\n' ' ' | tee -a $L; echo | tee -a $L
}
left 130 && bench $BASE base1
left 130 && bench $R new1
if left 60; then
  log "pytest one-GPU suites"
  PYTHONPATH=$R timeout $((BUDGET - SECONDS - 5)) python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts= -x \
    tests/gpu/test_gpu_runtime_one_gpu.py tests/gpu/test_gpu_contract.py tests/gpu/test_gpu_collectives.py \
    tests/gpu/test_overlap_gpu.py tests/gpu/test_overlap_gemm.py > $OUT/pytest_one_gpu.log 2>&1
  echo "pytest one_gpu rc=$?" | tee -a $L; tail -4 $OUT/pytest_one_gpu.log | tee -a $L
  grep -h "^FAILED\|^ERROR" $OUT/pytest_one_gpu.log | head -10 | tee -a $L
fi
log end
cd $OUT && tar czf logs.tgz --exclude=log.txt --exclude=logs.tgz * 2>/dev/null
find $OUT -mindepth 1 ! -name log.txt ! -name logs.tgz ! -name '*.json' ! -name '*.md' -type f -delete 2>/dev/null
find $OUT -type d -empty -delete 2>/dev/null; find $OUT -type f | head -40
