#!/usr/bin/env bash
# One device call, from the repository root, OUT set: this tree (its modules in NEW_SO, default
# .carry/new) against a previous build (BASE: a tree of that version with its modules in jax_dfccl/,
# default .carry/base), in this order, each part while BUDGET (default 575 s) allows:
#   KEEP_STEPS  (default "chain forced gemm"): tools/testbed_failures.sh steps run by both builds,
#               interleaved (base, new, base, new, ...); a step named twice runs twice per build.
#               KEEP_BUILDS (default "base new") names the builds and their order; "exp" is a third
#               tree (EXP: a tree with its modules in jax_dfccl/, e.g. a variant that turns a part off).
#   FAIL_STEPS  (default "abandon retry"): tools/testbed_failures.sh steps, this tree only.
#   AFTER       (default "bench pytest"), this tree only unless said:
#     costs   tools/ffi_stage_probe/costs.py (what XLA's FFI stages cost per call on the host)
#     bench   start/done against blocking, both builds (mp_worker.py --case bench_async; BENCH_SIZES
#             bytes per rank, default 4096,1048576,4194304; BENCH_FORMS a subset of the forms)
#     soak    tests/gpu/soak_worker.py, one GPU and two processes under MPS (SOAK_N instances, 10000)
#     stall   the two-process soak with small_slots=2 (SOAK_S2_N instances, 2000; STALL_CONFIG: the
#             config entries, default small_slots=2), both builds (this tree's worker), a stalled rank
#             printing jax_dfccl.pending() after 20 s (--watch)
#     mp      tests/gpu/test_gpu_multiprocess.py (the two- and four-process suite)
#     nvshmem tests/gpu/test_nvshmem_transport.py (protocol C over NVSHMEM, 2 and 4 processes)
#     peer    benchmarks/nvshmem_peer.py: our collectives beside NVSHMEM's own, 2 and 4 processes (PEER_SIZES,
#             default 4K,64K,1M,16M,64M; PEER_OPS, default psum,all_gather,all_to_all; PEER4_CONFIG: config
#             entries of the 4-process run; PEER_NP: the process counts, default "2 4")
#     pytest  the one-GPU suites
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
R=$PWD; L=$OUT/log.txt; : > $L
BASE=$(cd ${BASE:-.carry/base} && pwd); NEW_SO=${NEW_SO:-.carry/new}
BUDGET=${BUDGET:-575}
log() { echo "=== $(date +%T) [$SECONDS s] $*" | tee -a $L; }
left() { [ $((SECONDS + $1)) -lt $BUDGET ]; }
cp $NEW_SO/*.so jax_dfccl/
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee -a $L
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE 'H[0-9]+' | tr 'A-Z' 'a-z')  # tags the files
python3 -c "import jax; print('jax', jax.__version__)" 2>&1 | tail -1 | tee -a $L
(cd $R && git log --oneline -1 2>/dev/null) | tee -a $L
n=0
keep() {  # $1: base|new|exp, $2: step
  local dir=$R tag=${NEW_TAG:-after46}; [ $1 = base ] && dir=$BASE && tag=${BASE_TAG:-before46}
  [ $1 = exp ] && dir=$EXP && tag=${EXP_TAG:-exp}
  n=$((n + 1)); local o=$OUT/keep${n}_$1_$2
  log "keep $2 ($1)"
  (cd $dir && OUT=$o FAIL_BUDGET_S=120 FORCED_TAG=${CARD:-gpu}_one_gpu_forced_${tag}_$n GEMM_TAG=${CARD:-gpu}_${tag}_$n \
     PYTHONPATH=$dir bash tools/testbed_failures.sh $2 > $o.log 2>&1)
  grep -h "rc=\|^|" $o.log | cut -c1-300 | head -20 | tee -a $L
  { cat $o/logs/chain/rank*.log 2>/dev/null || tar xzf $o/logs.tgz -O --wildcards '*chain/rank*.log' 2>/dev/null; } |
    grep -o '"[a-z_]*donated_us": [0-9.]*' | tr '\n' ' ' | tee -a $L; echo | tee -a $L
  # CHAIN_ARGS=--profile: the donated chain's device timeline (period, kernels, idle gaps between them)
  { cat $o/logs/chain/rank0.log 2>/dev/null || tar xzf $o/logs.tgz -O --wildcards '*chain/rank0.log' 2>/dev/null; } |
    python3 -c '
import json, sys
for l in sys.stdin:
  if l.startswith("RESULT "):
   for row in json.loads(l[7:]).get("sizes", {}).values():
    for k, t in row.items():
      if k.endswith("_timeline") and t:
        print(k, "period_us", round(t["period_us"], 3))
        for n, v in t["kernels"].items(): print("  kernel", n, v["count"], round(v["median_us"], 3))
        for n, v in t["gaps"].items(): print("  gap", n, v["count"], round(v["median_us"], 3))
' 2>/dev/null | head -40 | tee -a $L
}
for step in ${KEEP_STEPS-chain forced gemm}; do
  for b in ${KEEP_BUILDS:-base new}; do left 90 && keep $b $step; done
done
if [ -n "${FAIL_STEPS-abandon retry}" ] && left 120; then
  log "failures (new build): ${FAIL_STEPS-abandon retry}"
  OUT=$OUT/failures FAIL_BUDGET_S=$((BUDGET - SECONDS - 100)) PYTHONPATH=$R \
    bash tools/testbed_failures.sh ${FAIL_STEPS-abandon retry} > $OUT/failures.log 2>&1
  grep -h "rc=\|^PROBE\|^RUN" $OUT/failures.log | cut -c1-260 | tee -a $L
fi
bench() {  # $1: package root, $2: name
  log "bench_async $2"
  PYTHONPATH=$1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout 130 tools/mps_testbed.sh -n 2 --tail 0 --timeout 110 \
    --out $OUT/ba_$2 -- python3 tests/gpu/mp_worker.py --case bench_async --sizes ${BENCH_SIZES:-4096,1048576,4194304} ${BENCH_FORMS:+--forms $BENCH_FORMS} > $OUT/ba_$2.log 2>&1
  echo "bench_async $2 rc=$?" | tee -a $L
  grep -h "^ROW" $OUT/ba_$2/rank*.log | sed "s/^/$2 /" | tee -a $L
  grep -h "^RESULT" $OUT/ba_$2/rank*.log | grep -o '"ok": [a-z]*' | tr '\n' ' ' | tee -a $L; echo | tee -a $L
}
for part in ${AFTER-bench pytest}; do
  case $part in
    costs)
      left 100 || continue; log "costs probe"
      timeout 90 python3 tools/ffi_stage_probe/costs.py --out $OUT/ffi_costs.json > $OUT/costs.log 2>&1
      echo "costs rc=$?" | tee -a $L; tail -12 $OUT/costs.log | tee -a $L ;;
    bench)
      left 130 && bench $BASE base1; left 130 && bench $R new1 ;;
    soak)
      left 80 || continue; log "soak one GPU"
      PYTHONPATH=$R timeout 70 python3 tests/gpu/soak_worker.py --instances ${SOAK_N:-10000} --seed 1 > $OUT/soak1.log 2>&1
      echo "soak one_gpu rc=$?" | tee -a $L; grep -h "^RESULT" $OUT/soak1.log | cut -c1-400 | tee -a $L
      for cfg in "" small_slots=2; do
        left 90 || continue; log "soak two processes ${cfg:-default}"
        PYTHONPATH=$R timeout 85 tools/mps_testbed.sh -n 2 --tail 0 --timeout 80 --out $OUT/soak2${cfg:+_s2} -- python3 \
          tests/gpu/soak_worker.py --instances ${SOAK_N:-10000} --seed 1 ${cfg:+--config $cfg} > $OUT/soak2${cfg:+_s2}.log 2>&1
        echo "soak two_processes ${cfg:-default} rc=$?" | tee -a $L
        grep -h "^RESULT" $OUT/soak2${cfg:+_s2}/rank*.log | cut -c1-400 | tee -a $L
      done ;;
    stall)
      for b in base new; do
        left 80 || continue; log "soak two processes small_slots=2 ($b)"
        root=$R; [ $b = base ] && root=$BASE
        PYTHONPATH=$root timeout 70 tools/mps_testbed.sh -n 2 --tail 0 --timeout 60 --out $OUT/stall_$b -- python3 \
          tests/gpu/soak_worker.py --instances ${SOAK_S2_N:-2000} --seed 1 --config ${STALL_CONFIG:-small_slots=2} --watch 20 \
          > $OUT/stall_$b.log 2>&1
        echo "stall $b rc=$?" | tee -a $L
        grep -h "^RESULT" $OUT/stall_$b/rank*.log | cut -c1-300 | tee -a $L
        grep -h -A30 "^STALLED" $OUT/stall_$b/rank*.log | cut -c1-300 | head -60 | tee -a $L
        grep -h "DEADLINE_EXCEEDED\|ABORTED\|Error: " $OUT/stall_$b/rank*.log | cut -c1-400 | head -6 | tee -a $L
      done ;;
    mp)
      left 100 || continue; log "pytest multiprocess suite"
      PYTHONPATH=$R timeout $((BUDGET - SECONDS - 5)) python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts= \
        tests/gpu/test_gpu_multiprocess.py > $OUT/pytest_mp.log 2>&1
      echo "pytest mp rc=$?" | tee -a $L; tail -4 $OUT/pytest_mp.log | tee -a $L
      grep -h "^FAILED\|^ERROR" $OUT/pytest_mp.log | head -10 | tee -a $L ;;
    nvshmem)
      left 100 || continue; log "pytest NVSHMEM transport"
      PYTHONPATH=$R timeout $((BUDGET - SECONDS - 5)) python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts= \
        tests/gpu/test_nvshmem_transport.py --basetemp=$OUT/nvshmem > $OUT/pytest_nvshmem.log 2>&1
      echo "pytest nvshmem rc=$?" | tee -a $L; tail -4 $OUT/pytest_nvshmem.log | tee -a $L
      grep -h "^RESULT" $OUT/nvshmem/*/nv*/rank*.log 2>/dev/null | cut -c1-700 | tee -a $L ;;
    peer)
      for np_ in ${PEER_NP:-2 4}; do
        left 100 || continue; log "peer: ours beside NVSHMEM's collectives, $np_ processes"
        PYTHONPATH=$R timeout $((BUDGET - SECONDS - 5)) tools/mps_testbed.sh -n $np_ --tail 0 --timeout $((BUDGET - SECONDS - 10)) \
          --out $OUT/peer$np_ -- python3 benchmarks/nvshmem_peer.py --sizes ${PEER_SIZES:-4K,64K,1M,16M,64M} \
          --ops ${PEER_OPS:-psum,all_gather,all_to_all} $([ $np_ = 4 ] && [ -n "${PEER4_CONFIG-}" ] && echo --config $PEER4_CONFIG) --out $OUT/peer_${CARD:-gpu}_$np_.json > $OUT/peer$np_.log 2>&1
        echo "peer $np_ rc=$?" | tee -a $L
        grep -h "^ROW" $OUT/peer$np_/rank0.log | cut -c1-300 | tee -a $L
        grep -h "Error\|error:" $OUT/peer$np_/rank*.log | cut -c1-300 | head -6 | tee -a $L
      done ;;
    pytest)
      left 60 || continue; log "pytest one-GPU suites"
      PYTHONPATH=$R timeout $((BUDGET - SECONDS - 5)) python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts= -x \
        tests/gpu/test_gpu_runtime_one_gpu.py tests/gpu/test_gpu_contract.py tests/gpu/test_gpu_collectives.py \
        tests/gpu/test_overlap_gpu.py tests/gpu/test_overlap_gemm.py > $OUT/pytest_one_gpu.log 2>&1
      echo "pytest one_gpu rc=$?" | tee -a $L; tail -4 $OUT/pytest_one_gpu.log | tee -a $L
      grep -h "^FAILED\|^ERROR" $OUT/pytest_one_gpu.log | head -10 | tee -a $L ;;
  esac
done
log end
cd $OUT && tar czf logs.tgz --exclude=log.txt --exclude=logs.tgz * 2>/dev/null
find $OUT -mindepth 1 ! -name log.txt ! -name logs.tgz ! -name '*.json' ! -name '*.md' -type f -delete 2>/dev/null
find $OUT -type d -empty -delete 2>/dev/null; find $OUT -type f | head -60
