"""The latency floor of two ranks on one GPU: a flag ping-pong between persistent kernels of two
processes, through device memory shared by CUDA IPC.

Run by tools/mps_testbed.sh (two processes; it sets DFCCL_TESTBED_RANK/NPROC/COORD/MPS/TMP):

    tools/mps_testbed.sh -n 2 -- python3 benchmarks/pingpong_mps.py --iters 10000 --json pp_mps.json
    tools/mps_testbed.sh --no-mps -n 2 -- python3 benchmarks/pingpong_mps.py --iters 200 --json pp_ts.json

Rank 0 allocates a 4 KiB flag buffer with cudaMalloc and exports it (cudaIpcGetMemHandle); rank 1
opens it (cudaIpcOpenMemHandle). The handle goes through the jax.distributed key-value store
(`--exchange kv`, jax.distributed.initialize with the testbed's coordinator; no JAX backend is
created) or through files in the testbed's scratch folder (`--exchange file`). Each rank then
launches one CuPy RawKernel of one thread that runs every round trip:

    rank 0: t0 = now; store.release.sys ping = k; wait until load.acquire.sys pong == k; rt = now - t0
    rank 1: wait until load.acquire.sys ping == k; store.release.sys pong = k

Protocol of the buffer (u32 words, each on its own 128-byte line): `ping`, `pong`, `alive[2]`
(each kernel stores the run's nonce when it runs, then waits for the peer's: the round trips start
only once both kernels are resident), `abort` (a kernel that gives up stores its rank + 1 there, so
the peer stops at its next poll instead of running into its own timeout). Values only grow
(k = 1, 2, ...), the buffer is zeroed before it is exported, and a value above the one awaited is
an error, so no stale value is mistaken for an answer. Every wait is bounded by `--wait-timeout-s`
(%globaltimer), the start handshake by `--start-timeout-s`: a kernel never spins forever, and
fails with a code the host turns into an error naming the rank, the iteration and the value seen.

Timing, on the device only: per round trip, the %globaltimer difference (ns) and the clock64
difference (SM cycles) are kept in shared memory (nothing but the flags is stored to global memory
inside the loop, so the release stores wait for no timestamp writes) and copied out at the end.
Rank 0 times send-to-answer; rank 1 the time between successive pings it sees (also one round
trip). %globaltimer may advance in steps of up to 1 µs, so the cycle-based figures (clock64
converted with the clock rate measured over the whole loop, SM-local: meaningful under MPS, where
the kernel is never moved) and the mean over the whole loop are reported beside it; the timer's
step is measured first. The first `--warmup` round trips are dropped.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # if jax is imported (--exchange kv)

KERNELS = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 now_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u32 load_acquire(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 sat32(u64 v) { return v > 0xffffffffull ? 0xffffffffu : (u32)v; }

enum { kPing = 0, kPong = 32, kAlive = 64, kAbort = 128 };   // word offsets (128-byte lines)
enum { kOk = 0, kNoPeer = 1, kTimeout = 2, kPeerAborted = 3, kBadValue = 4 };

// Waits until *p == want. Returns kOk, or kTimeout / kPeerAborted / kBadValue (a value above
// want: never written by a correct peer) with the value seen in *seen.
__device__ int wait_eq(const u32* p, u32 want, const u32* abort_word, u64 timeout_ns, u32* seen) {
  const u64 t0 = now_ns();
  for (u32 n = 1;; ++n) {
    const u32 v = load_acquire(p);
    if (v == want) return kOk;
    if (v > want) { *seen = v; return kBadValue; }
    if ((n & 63) == 0) {
      if (load_acquire(abort_word) != 0) { *seen = v; return kPeerAborted; }
      if (now_ns() - t0 > timeout_ns) { *seen = v; return kTimeout; }
    }
  }
}

// status: [0] code, [1] iteration (1-based; 0: the start handshake), [2] value seen,
// [3] t_begin (ns), [4] t_end (ns), [5] clock64 begin, [6] clock64 end.
// out: 2 * iters u32 written at the end: ns per round trip, then cycles per round trip.
extern "C" __global__ void pingpong(u32* buf, int rank, u32 nonce, int iters, u64 timeout_ns,
                                    u64 start_timeout_ns, u32* out, u64* status) {
  extern __shared__ u32 smem[];          // [iters] ns, then [iters] cycles
  if (threadIdx.x != 0) return;
  u32* ping = buf + kPing;
  u32* pong = buf + kPong;
  u32* abort_word = buf + kAbort;
  store_release(buf + kAlive + 32 * rank, nonce);
  u32 seen = 0;
  int code = wait_eq(buf + kAlive + 32 * (1 - rank), nonce, abort_word, start_timeout_ns, &seen);
  if (code == kBadValue) code = kNoPeer;  // another run's nonce: not our peer
  if (code == kTimeout) code = kNoPeer;
  int k = 1;
  const u64 t_begin = now_ns();
  const long long c_begin = clock64();
  u64 t_prev = t_begin;
  long long c_prev = c_begin;
  for (; code == kOk && k <= iters; ++k) {
    if (rank == 0) {
      const u64 t0 = now_ns();
      const long long c0 = clock64();
      store_release(ping, (u32)k);
      code = wait_eq(pong, (u32)k, abort_word, timeout_ns, &seen);
      const long long c1 = clock64();
      const u64 t1 = now_ns();
      smem[k - 1] = sat32(t1 - t0);
      smem[iters + k - 1] = sat32((u64)(c1 - c0));
    } else {
      code = wait_eq(ping, (u32)k, abort_word, timeout_ns, &seen);
      if (code == kOk) store_release(pong, (u32)k);
      const u64 t1 = now_ns();
      const long long c1 = clock64();
      smem[k - 1] = sat32(t1 - t_prev);      // ping k-1 seen -> ping k seen
      smem[iters + k - 1] = sat32((u64)(c1 - c_prev));
      t_prev = t1;
      c_prev = c1;
    }
  }
  const u64 t_end = now_ns();
  const long long c_end = clock64();
  if (code != kOk) {
    store_release(abort_word, (u32)(rank + 1));
    --k;
  }
  for (int i = 0; i < 2 * iters; ++i) out[i] = smem[i];
  status[0] = (u64)code;
  status[1] = code == kOk ? 0 : (u64)k;
  status[2] = seen;
  status[3] = t_begin;
  status[4] = t_end;
  status[5] = (u64)c_begin;
  status[6] = (u64)c_end;
}

// The step of %globaltimer: the first n changes seen in a tight loop (ns between changes; the
// loop gives up after 2^26 reads, leaving zeros).
extern "C" __global__ void timer_step(u64* out, int n) {
  if (threadIdx.x != 0) return;
  u64 last = now_ns();
  for (int i = 0, reads = 0; i < n && reads < (1 << 26); ++reads) {
    const u64 t = now_ns();
    if (t != last) { out[i++] = t - last; last = t; }
  }
}
"""

CODES = {1: "the peer's kernel never started (start handshake)", 2: "timed out waiting for the peer",
         3: "the peer gave up first", 4: "saw a value above the one awaited"}
BUF_BYTES = 4096
MAX_SMEM = 227 * 1024  # per block on sm90 with the opt-in attribute


def parse():
  env = os.environ.get
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                               epilog="Defaults of --rank/--nproc/--coord/--dir come from tools/mps_testbed.sh's DFCCL_TESTBED_*.")
  ap.add_argument("--iters", type=int, default=10000, help="round trips timed (default 10000)")
  ap.add_argument("--warmup", type=int, default=100, help="round trips before them, dropped (default 100)")
  ap.add_argument("--wait-timeout-s", type=float, default=2.0, help="bound of one wait on the device (default 2; < 4.29)")
  ap.add_argument("--start-timeout-s", type=float, default=30.0, help="bound of the kernels' start handshake (default 30)")
  ap.add_argument("--json", help="write the figures there (rank 0)")
  ap.add_argument("--exchange", choices=("kv", "file"), default="kv",
                  help="how the IPC handle travels: jax.distributed key-value store (default) or files in --dir")
  ap.add_argument("--rank", type=int, default=int(env("DFCCL_TESTBED_RANK", "-1")))
  ap.add_argument("--nproc", type=int, default=int(env("DFCCL_TESTBED_NPROC", "2")))
  ap.add_argument("--coord", default=env("DFCCL_TESTBED_COORD"))
  ap.add_argument("--dir", default=env("DFCCL_TESTBED_TMP"), help="folder shared by the two ranks (--exchange file)")
  ap.add_argument("--dry-run", action="store_true",
                  help="no GPU: exchange a dummy handle, run the barriers and write the JSON without figures")
  a = ap.parse_args()
  if a.rank not in (0, 1) or a.nproc != 2:
    ap.error(f"needs exactly two ranks (got --rank {a.rank} --nproc {a.nproc}); run it under tools/mps_testbed.sh -n 2")
  if not 0 < a.wait_timeout_s < 4.29:
    ap.error("--wait-timeout-s must lie in (0, 4.29)")
  total = a.warmup + a.iters
  if a.iters < 1 or a.warmup < 0 or 8 * total > MAX_SMEM:
    ap.error(f"--warmup + --iters must be at most {MAX_SMEM // 8} (their timestamps live in shared memory)")
  if a.exchange == "kv" and not a.coord:
    ap.error("--exchange kv needs --coord (or DFCCL_TESTBED_COORD)")
  if a.exchange == "file" and not a.dir:
    ap.error("--exchange file needs --dir (or DFCCL_TESTBED_TMP)")
  return a


class FileExchange:
  """Files in a folder both ranks see (written to a temporary name, then renamed)."""

  def __init__(self, a):
    self._dir, self._rank, self._n = a.dir, a.rank, a.nproc

  def put(self, key, value: bytes):
    path = os.path.join(self._dir, f"pp.{key}")
    with open(path + f".tmp{self._rank}", "wb") as f:
      f.write(value)
    os.replace(path + f".tmp{self._rank}", path)

  def get(self, key, timeout_s=60.0) -> bytes:
    path, deadline = os.path.join(self._dir, f"pp.{key}"), time.monotonic() + timeout_s
    while not os.path.exists(path):
      if time.monotonic() > deadline:
        raise TimeoutError(f"rank {self._rank}: no {path} after {timeout_s} s")
      time.sleep(0.01)
    with open(path, "rb") as f:
      return f.read()

  def barrier(self, name, timeout_s=60.0):
    self.put(f"barrier.{name}.{self._rank}", b"1")
    for r in range(self._n):
      self.get(f"barrier.{name}.{r}", timeout_s)

  def close(self):
    pass


def stats_us(ns) -> dict:
  import numpy as np
  v = np.asarray(ns, dtype=np.float64) / 1e3
  p10, p50, p90 = np.percentile(v, [10, 50, 90])
  return {"median_us": round(p50, 3), "p10_us": round(p10, 3), "p90_us": round(p90, 3),
          "min_us": round(v.min(), 3), "max_us": round(v.max(), 3), "mean_us": round(v.mean(), 3)}


def run_gpu(a, ex) -> dict:
  try:
    import cupy as cp
  except ImportError as e:  # the CPU machine: --help and --dry-run work without CuPy
    sys.exit(f"pingpong_mps: CuPy is needed to run on the GPU ({e}); --dry-run works without it")
  import numpy as np
  rt = cp.cuda.runtime
  cp.cuda.Device(0).use()
  kern, step_kern = cp.RawKernel(KERNELS, "pingpong"), cp.RawKernel(KERNELS, "timer_step")
  total = a.warmup + a.iters
  smem = 8 * total
  kern.max_dynamic_shared_size_bytes = smem
  out = cp.zeros(2 * total, dtype=cp.uint32)
  status = cp.zeros(8, dtype=cp.uint64)
  steps = cp.zeros(64, dtype=cp.uint64)
  stream = cp.cuda.Stream(non_blocking=True)
  step_kern((1,), (32,), (steps, np.int32(64)), stream=stream)
  stream.synchronize()
  timer_steps = cp.asnumpy(steps)
  timer_steps = timer_steps[timer_steps > 0] if (timer_steps > 0).any() else timer_steps

  if a.rank == 0:
    buf = rt.malloc(BUF_BYTES)  # a cudaMalloc of its own: the IPC handle names this allocation's base
    rt.memset(buf, 0, BUF_BYTES)
    rt.deviceSynchronize()
    nonce = 1 + secrets.randbelow(2**31 - 1)
    ex.put("handle", bytes(rt.ipcGetMemHandle(buf)))
    ex.put("nonce", str(nonce).encode())
  else:
    handle, nonce = ex.get("handle"), int(ex.get("nonce"))
    buf = rt.ipcOpenMemHandle(handle)  # flags: cudaIpcMemLazyEnablePeerAccess
  ex.barrier("launch")
  kern((1,), (32,), (np.uint64(buf), np.int32(a.rank), np.uint32(nonce), np.int32(total),
                     np.uint64(int(a.wait_timeout_s * 1e9)), np.uint64(int(a.start_timeout_s * 1e9)), out, status),
       stream=stream, shared_mem=smem)
  stream.synchronize()
  st = [int(x) for x in cp.asnumpy(status)]
  vals = cp.asnumpy(out)
  if a.rank == 1:
    rt.ipcCloseMemHandle(buf)
  ex.barrier("closed")  # rank 0 frees the buffer only once the peer closed its mapping
  if a.rank == 0:
    rt.free(buf)
  if st[0] != 0:
    what = "the start handshake" if st[1] == 0 else f"round trip {st[1]} of {total}"
    raise RuntimeError(f"pingpong_mps: rank {a.rank}: {CODES.get(st[0], st[0])} at {what} "
                       f"(last value seen {st[2]})")
  ns, cyc = vals[:total][a.warmup:], vals[total:][a.warmup:]
  if a.rank == 1 and a.warmup == 0:
    ns, cyc = ns[1:], cyc[1:]  # its first interval starts at the handshake, not at a ping
  span_ns, span_cyc = st[4] - st[3], st[6] - st[5]
  ghz = span_cyc / span_ns if span_ns > 0 else 0.0
  props = rt.getDeviceProperties(0)
  res = {"rank": a.rank, "round_trips": int(len(ns)), "globaltimer": stats_us(ns),
         "mean_over_loop_us": round(span_ns / total / 1e3, 3),
         "sm_clock_ghz_measured": round(ghz, 4),
         "globaltimer_step_ns": {"min": int(timer_steps.min()), "median": int(np.median(timer_steps))}}
  if 0.3 < ghz < 4.0:
    res["clock64"] = stats_us(np.asarray(cyc, dtype=np.float64) / ghz)
  res["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
  res["driver"] = rt.driverGetVersion()
  res["runtime"] = rt.runtimeGetVersion()
  res["cupy"] = cp.__version__
  return res


def main():
  a = parse()
  if a.exchange == "kv":
    from common import KvExchange  # noqa: PLC0415 - imports jax: after the environment above
    ex = KvExchange(a.coord, a.nproc, a.rank, "dfccl_pingpong")
  else:
    ex = FileExchange(a)
  try:
    if a.dry_run:
      if a.rank == 0:
        ex.put("handle", os.urandom(64))
      else:
        assert len(ex.get("handle")) == 64
      ex.barrier("launch")
      ex.barrier("closed")
      res = {"rank": a.rank, "dry_run": True}
    else:
      res = run_gpu(a, ex)
    if a.rank == 1:
      ex.put("result1", json.dumps(res).encode())
    else:
      peer = json.loads(ex.get("result1", timeout_s=120))
      g = res.get("globaltimer", {})
      from common import testbed_header, write_json  # noqa: PLC0415 - imports jax
      doc = {
          **testbed_header("pingpong_mps", res.get("device")),
          "exchange": a.exchange, "iters": a.iters, "warmup": a.warmup,
          "wait_timeout_s": a.wait_timeout_s,
          "what": "rank 0: per round trip, store.release.sys ping -> load.acquire.sys sees pong (one-thread "
                  "persistent kernels of two processes, one GPU, flags in cudaMalloc memory shared by CUDA IPC); "
                  "rank 1: time between successive pings seen",
          "rank0": res, "rank1": peer,
      }
      if a.json:
        write_json(a.json, doc)
      mode = {True: "MPS", False: "no MPS (time slicing)", None: "MPS unknown"}[doc["mps"]]
      if g:
        c = res.get("clock64", {})
        print(f"pingpong_mps [{mode}] {a.iters} round trips: median {g['median_us']} us "
              f"(p10 {g['p10_us']}, p90 {g['p90_us']}; clock64 median {c.get('median_us')}; "
              f"mean over the loop {res['mean_over_loop_us']}; rank 1 median "
              f"{peer.get('globaltimer', {}).get('median_us')}; %globaltimer step {res['globaltimer_step_ns']['median']} ns)")
      else:
        print(f"pingpong_mps [{mode}] dry run: handle exchanged through '{a.exchange}', barriers passed")
      if a.json:
        print(f"pingpong_mps: wrote {a.json}")
  finally:
    ex.close()


if __name__ == "__main__":
  main()
