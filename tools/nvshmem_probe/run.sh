#!/usr/bin/env bash
# One device call's worth of the NVSHMEM probe (about 1-2 minutes; at most NVS_BUDGET_S, 230 s).
# From the repository root, with OUT set (the device machine's result folder):
#
#   OUT=$OUT tools/nvshmem_probe/run.sh
#
# 1. Rebuilds tools/nvshmem_probe/build/probe against the machine's NVSHMEM (the pip package of
#    python3, or NVSHMEM_HOME); if that fails, runs a carried build/probe (built elsewhere) with
#    LD_LIBRARY_PATH pointing at the machine's NVSHMEM libraries.
# 2. 2 PEs on the one GPU under MPS (tools/mps_testbed.sh -n 2): the ping-pong and the collectives
#    -> $OUT/nvshmem_pp_2.json, logs in $OUT/nvs2/.
# 3. 4 PEs, the collectives only -> $OUT/nvshmem_coll_4.json, logs in $OUT/nvs4/.
# 4. If time is left: 4 PEs again with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 in each process and
#    NVSHMEM's ignore switch off (NVSHMEM's documented full-MPG condition: the PEs of a GPU add up
#    to <= 100 %) -> $OUT/nvshmem_coll_4_atp25.json, logs in $OUT/nvs4_atp25/.
# A step whose run fails prints the ranks' errors and is run once more with NVSHMEM_DEBUG=INFO
# (logs in $OUT/<step>_debug/), so the log says why.  Ends with a summary; exit status 0 if
# steps 2 and 3 passed.
set -u
cd "$(dirname "$0")/../.." || exit 2
[[ -n ${OUT:-} ]] || { echo "run.sh: set OUT (a folder for the results)" >&2; exit 2; }
mkdir -p "$OUT"
HERE=tools/nvshmem_probe
T0=$SECONDS
BUDGET=${NVS_BUDGET_S:-230}
left() { echo $((BUDGET - (SECONDS - T0))); }
say() { echo "run.sh [$((SECONDS - T0)) s]: $*"; }

# The environment of every run.  NVLink multicast stays off (machine rule); NVSHMEM gets no
# network transport (one host), bootstraps over loopback, keeps its own collectives (no NCCL: NVSHMEM
# turns NCCL off under MPS anyway), and runs in full MPG mode although every PE may use all SMs.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-1G}
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
export NVSHMEM_DISABLE_NCCL=1
export NVSHMEM_INFO=1

# ---- 1. build
PROBE=$HERE/build/probe
PREBUILT=""
if [[ -x $PROBE ]]; then PREBUILT=$(mktemp /tmp/nvshmem_probe.XXXXXX) && cp "$PROBE" "$PREBUILT"; fi
say "building against this machine's NVSHMEM"
if timeout 120 "$HERE/build.sh" > "$OUT/build.log" 2>&1; then
  BUILT=rebuilt
  say "built: $(head -n 1 "$OUT/build.log")"
else
  rc=$?
  say "build failed (status $rc); last lines of $OUT/build.log:"
  tail -n 15 "$OUT/build.log"
  [[ -n $PREBUILT ]] || { say "no carried build/probe to fall back on"; exit 1; }
  BUILT=carried
  cp "$PREBUILT" "$PROBE"
  NVH=${NVSHMEM_HOME:-$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])' 2>/dev/null)}
  [[ -n $NVH && -d $NVH/lib ]] && export LD_LIBRARY_PATH=$NVH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  say "running the carried binary with LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
fi
[[ -n $PREBUILT ]] && rm -f "$PREBUILT"
echo "nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1)"

# ---- a testbed run: run_step NAME NPROC STEP_TIMEOUT_S PROBE_ARGS...; sets STATUS[NAME]
declare -A STATUS
run_step() {
  local name=$1 n=$2 want=$3; shift 3
  local l; l=$(left)
  local t=$(( want < l - 25 ? want : l - 25 ))
  if (( t < 20 )); then say "$name: skipped, $l s left"; STATUS[$name]=skipped; return 1; fi
  say "$name: $n PEs, timeout ${t}s: $PROBE $*"
  timeout $((t + 25)) tools/mps_testbed.sh -n "$n" --timeout "$t" --tail 20 --out "$OUT/$name" -- "$PROBE" "$@" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  STATUS[$name]=$rc
  grep -h "statuses:" "$OUT/$name.log" | sed "s/^/  /"
  grep -h "init status" "$OUT/$name"/rank*.log 2>/dev/null | sed "s/^/  /"
  grep -h "SUMMARY" "$OUT/$name/rank0.log" 2>/dev/null | sed "s/^/  /"
  if [[ $rc != 0 ]]; then
    say "$name failed (status $rc); the ranks' errors:"
    grep -h -i "error\|timed out\|abort\|warn\|MPG\|not supported\|non-zero\|fail" "$OUT/$name"/rank*.log 2>/dev/null |
      sed 's/^probe\[PE [0-9]*\][ 0-9.]* s: //' | sort | uniq -c | sort -rn | head -n 20
    local f
    for f in "$OUT/$name"/rank*.log; do echo "  -- last lines of $f"; tail -n 6 "$f" | cut -c1-400 | sed 's/^/     /'; done

  fi
  return $rc
}

# A failed step once more with NVSHMEM's INFO log.
retry_debug() {
  local name=$1; shift
  say "$name: once more with NVSHMEM_DEBUG=INFO"
  NVSHMEM_DEBUG=INFO NVSHMEM_DEBUG_SUBSYS=INIT,BOOTSTRAP,TRANSPORT,MEM,COLL run_step "${name}_debug" "$@"
  if [[ ${STATUS[${name}_debug]} != 0 && ${STATUS[${name}_debug]} != skipped ]]; then
    grep -h -i "MPG\|MPS\|p2p\|can_reach\|cumem\|vmm\|ipc\|error\|fail" "$OUT/${name}_debug"/rank*.log 2>/dev/null | head -n 40
  fi
}

# ---- 2. two PEs: ping-pong and collectives
export NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1
BOUNDS=(--boot-timeout-s 40 --start-timeout-s 15 --step-timeout-s 20)
run_step nvs2 2 75 "${BOUNDS[@]}" --json "$OUT/nvshmem_pp_2.json" ||
  retry_debug nvs2 2 60 "${BOUNDS[@]}" --json "$OUT/nvshmem_pp_2_debug.json"

# ---- 3. four PEs: collectives
run_step nvs4 4 75 "${BOUNDS[@]}" --mode coll --json "$OUT/nvshmem_coll_4.json" ||
  retry_debug nvs4 4 60 "${BOUNDS[@]}" --mode coll --json "$OUT/nvshmem_coll_4_debug.json"

# ---- 4. four PEs, 25 % of the SMs each (NVSHMEM's own full-MPG condition), if time is left
unset NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
if [[ ${STATUS[nvs4]} == 0 ]] && (( $(left) > 80 )); then
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 run_step nvs4_atp25 4 50 "${BOUNDS[@]}" --mode coll --json "$OUT/nvshmem_coll_4_atp25.json"
else
  STATUS[nvs4_atp25]=skipped
fi

# ---- summary
echo
echo "===== nvshmem_probe summary ($((SECONDS - T0)) s; binary $BUILT: $(cat $HERE/build/nvshmem_version 2>/dev/null || echo '?'))"
for s in nvs2 nvs2_debug nvs4 nvs4_debug nvs4_atp25; do
  [[ -n ${STATUS[$s]:-} ]] || continue
  echo "-- $s: status ${STATUS[$s]}"
  grep -h "init status" "$OUT/$s"/rank*.log 2>/dev/null | sed 's/^/   /'
  grep -h "SUMMARY" "$OUT/$s/rank0.log" 2>/dev/null | sed 's/^/   /'
  grep -h "error:\|timed out" "$OUT/$s"/rank*.log 2>/dev/null | head -n 4 | sed 's/^/   /'
done
ls "$OUT"/*.json 2>/dev/null | sed 's/^/json: /'
[[ ${STATUS[nvs2]} == 0 || ${STATUS[nvs2_debug]:-1} == 0 ]] && [[ ${STATUS[nvs4]} == 0 || ${STATUS[nvs4_debug]:-1} == 0 ]]
