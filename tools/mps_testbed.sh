#!/usr/bin/env bash
# Runs one command as N processes on one GPU, under CUDA MPS (or time-sliced with --no-mps).
#
#   tools/mps_testbed.sh [-n N] [--timeout S] [--out DIR] [--tail L] [--no-mps] -- CMD [ARGS...]
#
#   -n N          processes (default 2)
#   --timeout S   wall-clock limit of the whole run in seconds (default 300); past it every
#                 process is killed and the run returns 124
#   --out DIR     per-rank logs (rank<i>.log: stdout and stderr) and the MPS logs
#                 (mps_control.log, mps_server.log) go there (default: a folder of the fresh
#                 /tmp directory, kept)
#   --tail L      lines of each rank's log printed at the end (default 60; 0: none)
#   --keep-going  a rank that fails does not stop the others (the run still returns the first
#                 failed rank's status): for tests in which a rank is killed on purpose
#   --no-mps      no MPS daemon: the processes' kernels share the GPU by time slicing.  The
#                 clients get an empty CUDA_MPS_PIPE_DIRECTORY, so a daemon started elsewhere
#                 with the default pipe directory is not joined either
#
# Each process runs CMD with, in its environment:
#   DFCCL_TESTBED_RANK   0 .. N-1
#   DFCCL_TESTBED_NPROC  N
#   DFCCL_TESTBED_COORD  127.0.0.1:<free port>   (for jax.distributed.initialize)
#   DFCCL_TESTBED_MPS    1 under MPS, 0 with --no-mps
#   DFCCL_TESTBED_TMP    a scratch folder shared by the N processes (removed at exit)
#   CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY  (under the fresh /tmp directory)
#   NVSHMEM_* for one host (P2P only, loopback bootstrap, 768M heap), unless already set
# These variables belong to the testbed and the scripts it runs; library code reads none.
#
# The MPS control daemon (`nvidia-cuda-mps-control -d`) is started with its pipe and log
# folders under a fresh /tmp directory and quit in an EXIT trap (`echo quit |
# nvidia-cuda-mps-control`), whatever ends the run: success, a failed rank, the timeout,
# SIGINT/SIGTERM/SIGHUP (not SIGKILL of this script).  A daemon still alive 15 s after quit
# (DFCCL_TESTBED_QUIT_S) is killed by the pid it wrote (nvidia-cuda-mps-control.pid), and so
# are the MPS servers it listed.  When one process fails the others are killed (SIGTERM to
# each one's process group, SIGKILL 5 s later).  Exit status: 0 if every process returned 0,
# else the status of the first one that failed (124 on timeout, 2 on a usage or setup error).
set -u

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "mps_testbed: $*" >&2; exit 2; }

NPROC=2 TIMEOUT=300 OUTDIR="" TAIL=60 MPS=1 KEEP_GOING=0
while [[ $# -gt 0 ]]; do
  case $1 in
    -n|--nproc) [[ $# -ge 2 ]] || die "$1 needs a value"; NPROC=$2; shift 2 ;;
    --timeout) [[ $# -ge 2 ]] || die "$1 needs a value"; TIMEOUT=$2; shift 2 ;;
    --out) [[ $# -ge 2 ]] || die "$1 needs a value"; OUTDIR=$2; shift 2 ;;
    --tail) [[ $# -ge 2 ]] || die "$1 needs a value"; TAIL=$2; shift 2 ;;
    --no-mps) MPS=0; shift ;;
    --keep-going) KEEP_GOING=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option '$1' (the command comes after --; see --help)" ;;
  esac
done
[[ $# -ge 1 ]] || die "no command given (usage: $0 [-n N] [--no-mps] -- CMD ARGS...)"
[[ $NPROC =~ ^[1-9][0-9]*$ ]] || die "-n must be a positive integer, got '$NPROC'"
[[ $TIMEOUT =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive integer (seconds), got '$TIMEOUT'"
[[ $TAIL =~ ^[0-9]+$ ]] || die "--tail must be a non-negative integer, got '$TAIL'"
if [[ $MPS == 1 ]] && ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  die "nvidia-cuda-mps-control not found on PATH (run with --no-mps to share the GPU by time slicing)"
fi
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || die "'$PY' not found (needed to pick a free port; set PYTHON)"

TMP=$(mktemp -d /tmp/dfccl_mps.XXXXXX) || die "mktemp failed"
OUTDIR=${OUTDIR:-$TMP/out}
mkdir -p "$OUTDIR" "$TMP/pipe" "$TMP/log" "$TMP/shared" || die "cannot create folders under $TMP / $OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
export CUDA_MPS_PIPE_DIRECTORY=$TMP/pipe CUDA_MPS_LOG_DIRECTORY=$TMP/log
# NVSHMEM on one host, for the scripts that set it up (each unless already set): P2P only,
# the unique-id bootstrap on loopback, no NVLink multicast, every PE may use all SMs under MPS.
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none} \
       NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo} \
       NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} NVSHMEM_DISABLE_NCCL=${NVSHMEM_DISABLE_NCCL:-1} \
       NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-768M} \
       NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-1}

PIDS=()        # rank i's process (leader of its own process group)
RCS=()         # rank i's exit status once known
MPS_STARTED=0
say() { echo "mps_testbed: $*"; }

kill_ranks() {  # SIGTERM to every live rank's process group, SIGKILL to what is left after 5 s
  local i live=0
  for i in "${!PIDS[@]}"; do
    [[ -z ${RCS[$i]:-} ]] && kill -0 "${PIDS[$i]}" 2>/dev/null || continue
    kill -TERM -- "-${PIDS[$i]}" 2>/dev/null || kill -TERM "${PIDS[$i]}" 2>/dev/null; live=1
  done
  [[ $live == 1 ]] || return 0
  for _ in $(seq 50); do
    live=0
    for i in "${!PIDS[@]}"; do [[ -z ${RCS[$i]:-} ]] && kill -0 "${PIDS[$i]}" 2>/dev/null && live=1; done
    [[ $live == 1 ]] || break; sleep 0.1
  done
  for i in "${!PIDS[@]}"; do
    [[ -z ${RCS[$i]:-} ]] || continue
    kill -KILL -- "-${PIDS[$i]}" 2>/dev/null || kill -KILL "${PIDS[$i]}" 2>/dev/null
    wait "${PIDS[$i]}" 2>/dev/null; RCS[$i]=$?
  done
}

quit_mps() {
  [[ $MPS_STARTED == 1 ]] || return 0
  MPS_STARTED=0
  local pidfile=$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid cpid="" servers=""
  [[ -f $pidfile ]] && cpid=$(tr -dc 0-9 < "$pidfile")
  servers=$(echo get_server_list | timeout 5 nvidia-cuda-mps-control 2>/dev/null | tr -dc '0-9\n')
  local wait_s=${DFCCL_TESTBED_QUIT_S:-15}
  echo quit | timeout "$wait_s" nvidia-cuda-mps-control >/dev/null 2>&1
  for _ in $(seq $((wait_s * 10))); do
    [[ -n $cpid ]] && kill -0 "$cpid" 2>/dev/null || break; sleep 0.1
  done
  local p
  for p in $cpid $servers; do
    if kill -0 "$p" 2>/dev/null; then say "MPS process $p still alive after quit: killed"; kill -KILL "$p" 2>/dev/null; fi
  done
  cp "$CUDA_MPS_LOG_DIRECTORY/control.log" "$OUTDIR/mps_control.log" 2>/dev/null
  cp "$CUDA_MPS_LOG_DIRECTORY/server.log" "$OUTDIR/mps_server.log" 2>/dev/null
  say "MPS daemon quit (server pids: ${servers//$'\n'/ })"
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  kill_ranks
  quit_mps
  rm -rf "$TMP/pipe" "$TMP/shared" "$TMP/log"
  [[ $OUTDIR == "$TMP"/* ]] || rmdir "$TMP" 2>/dev/null
  exit "$rc"
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT
trap 'say "terminated"; exit 143' TERM
trap 'say "hang-up"; exit 129' HUP

if [[ $MPS == 1 ]]; then
  nvidia-cuda-mps-control -d || die "nvidia-cuda-mps-control -d failed (status $?)"
  MPS_STARTED=1
  for _ in $(seq 100); do [[ -e $CUDA_MPS_PIPE_DIRECTORY/control ]] && break; sleep 0.1; done
  [[ -e $CUDA_MPS_PIPE_DIRECTORY/control ]] || die "the MPS control daemon made no pipe in $CUDA_MPS_PIPE_DIRECTORY within 10 s"
  say "MPS control daemon started (pipe $CUDA_MPS_PIPE_DIRECTORY)"
else
  say "no MPS: $NPROC processes share the GPU by time slicing"
fi

PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') \
  || die "could not pick a free port"
say "$NPROC processes, coordinator 127.0.0.1:$PORT, logs in $OUTDIR, timeout ${TIMEOUT}s: $*"

set -m  # every background job gets its own process group: a rank is killed with its children
for ((i = 0; i < NPROC; i++)); do
  DFCCL_TESTBED_RANK=$i DFCCL_TESTBED_NPROC=$NPROC DFCCL_TESTBED_COORD=127.0.0.1:$PORT \
    DFCCL_TESTBED_MPS=$MPS DFCCL_TESTBED_TMP=$TMP/shared PYTHONUNBUFFERED=1 \
    "$@" > "$OUTDIR/rank$i.log" 2>&1 < /dev/null &
  PIDS[$i]=$!
done
set +m

T0=$SECONDS FAILED="" STATUS=0
while :; do
  running=0
  for i in "${!PIDS[@]}"; do
    [[ -z ${RCS[$i]:-} ]] || continue
    if kill -0 "${PIDS[$i]}" 2>/dev/null; then running=$((running + 1)); continue; fi
    wait "${PIDS[$i]}"; RCS[$i]=$?
    say "rank $i exited with status ${RCS[$i]} after $((SECONDS - T0)) s"
    if [[ ${RCS[$i]} != 0 && -z $FAILED ]]; then FAILED=$i; STATUS=${RCS[$i]}; fi
  done
  [[ $running == 0 ]] && break
  if [[ -n $FAILED && $KEEP_GOING == 0 ]]; then say "rank $FAILED failed: killing the others"; kill_ranks; break; fi
  if (( SECONDS - T0 >= TIMEOUT )); then
    say "timeout after ${TIMEOUT}s: killing every rank"; STATUS=124; FAILED=timeout; kill_ranks; break
  fi
  sleep 0.1
done

if [[ $TAIL != 0 ]]; then
  for i in "${!PIDS[@]}"; do
    echo "----- rank $i (status ${RCS[$i]:-?}; last $TAIL lines of $OUTDIR/rank$i.log)"
    tail -n "$TAIL" "$OUTDIR/rank$i.log" | sed "s/^/[rank $i] /"
  done
fi
summary=""; for i in "${!PIDS[@]}"; do summary+=" rank$i=${RCS[$i]:-?}"; done
say "statuses:$summary -> $STATUS"
exit "$STATUS"
