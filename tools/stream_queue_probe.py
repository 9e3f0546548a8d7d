"""Can a kernel launched on one stream start while another stream's work is blocked?

The daemon kernel quits when idle and the proxy thread relaunches it on its own stream when
work arrives, while XLA's stream may hold a kernel that waits for the daemon (a done kernel, a
blocking submit kernel) with more work queued behind it.  Two ways that launch could be held up:

  queues   CUDA serves streams through CUDA_DEVICE_MAX_CONNECTIONS hardware work queues (8 by
           default, read when the context is created).  Streams that share a queue are served in
           order, so a kernel queued behind another stream's blocked work cannot start: a false
           dependency.  Test: stream 0 gets a kernel that spins on a host-mapped flag, then a
           kernel that depends on it; every other stream gets a kernel that only writes a word.
           Words still unwritten after --wait-s are the streams held behind stream 0.  The last
           8 streams are created with the highest priority (held too, or queues of their own?).
  depth    A launch blocks the host once a stream holds about a thousand pending operations.
           Test: one thread fills stream 0 behind the spinning kernel until its launches block;
           then another thread launches on a stream that shares no queue with it: does that
           launch return, and does its kernel run, while the first thread is blocked?

Every spin gives up after --spin-s (reported), so the probe always ends.  Needs CuPy.
  python tools/stream_queue_probe.py [--streams 40] [--json FILE]
  python tools/stream_queue_probe.py --connections 1,8,32 --json FILE   (one child per value)
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

SRC = r'''
extern "C" __global__ void spin(volatile unsigned int* flag, unsigned long long timeout_ns,
                                volatile unsigned int* result) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (*flag == 0u) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > timeout_ns) { *result = 2u; __threadfence_system(); return; }
    __nanosleep(1000);
  }
  *result = 1u;
  __threadfence_system();
}
extern "C" __global__ void mark(volatile unsigned int* word, unsigned int v) {
  *word = v;
  __threadfence_system();
}
extern "C" __global__ void noop() {}
'''


def _words(ptr, n):
  return (ctypes.c_uint32 * n).from_address(ptr)


def probe(streams, wait_s, spin_s, depth_max):
  import cupy as cp
  import numpy as np
  mod = cp.RawModule(code=SRC)
  spin, mark, noop = (mod.get_function(f) for f in ("spin", "mark", "noop"))
  nwords = 64 + streams
  ptr = cp.cuda.runtime.hostAlloc(4 * nwords, 2)  # cudaHostAllocMapped; with UVA the pointer works on the device
  w = _words(ptr, nwords)
  FLAG, RESULT, BMARK = 0, 1, 2  # words: the spin's flag, its result, the depth test's mark; marks from 64
  one = (1,)

  def reset():
    for i in range(nwords):
      w[i] = 0

  def launch(fn, stream, *args):
    with stream:
      fn(one, one, args)

  def start_spin():  # stream 0: spins on FLAG until set or spin_s
    launch(spin, ss[0], np.uint64(ptr + 4 * FLAG), np.uint64(int(spin_s * 1e9)), np.uint64(ptr + 4 * RESULT))

  # The last few streams with the highest priority (do they get queues of their own?); created
  # once, in order (the order in which streams are created decides the queues they share).
  try:
    lo, hi = cp.cuda.runtime.deviceGetStreamPriorityRange()
  except AttributeError:  # an older CuPy: the H100/H200 range
    lo, hi = 0, -5
  n_hi = min(8, streams - 1)
  ss = [cp.cuda.Stream(non_blocking=True, priority=hi if i >= streams - n_hi else lo) for i in range(streams)]
  out = {"connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "(default)"), "streams": streams,
         "high_priority_streams": list(range(streams - n_hi, streams)), "priority_range": [lo, hi]}

  # Queues: which streams' kernels wait behind stream 0's blocked work.
  for trailing in (0, 1):
    reset()
    start_spin()
    for _ in range(trailing):  # depends on the spin (same stream)
      launch(noop, ss[0])
    t0 = time.perf_counter()
    for i in range(1, streams):
      launch(mark, ss[i], np.uint64(ptr + 4 * (64 + i)), np.uint32(1))
    launch_ms = (time.perf_counter() - t0) * 1e3
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(w[64 + i] == 0 for i in range(1, streams)):
      time.sleep(0.005)
    held = [i for i in range(1, streams) if w[64 + i] == 0]
    w[FLAG] = 1
    for s in ss:
      s.synchronize()
    out[f"queues_trailing{trailing}"] = {
        "held_streams": held, "held": len(held), "launch_ms": round(launch_ms, 3),
        "spin": {1: "released", 2: "timed out"}.get(w[RESULT], "not run")}

  # Depth: fill stream 0 until a launch blocks, then launch on a stream that shares no queue with it.
  free = [i for i in range(1, streams) if i not in out["queues_trailing1"]["held_streams"]]
  reset()
  start_spin()
  count = [0]

  def fill():
    for _ in range(depth_max):
      launch(noop, ss[0])
      count[0] += 1
  filler = threading.Thread(target=fill, daemon=True)
  filler.start()
  last, still = -1, time.monotonic()
  while filler.is_alive() and time.monotonic() - still < 0.3:
    if count[0] != last:
      last, still = count[0], time.monotonic()
    time.sleep(0.01)
  depth = {"filled": count[0], "filler_blocked": filler.is_alive()}
  if free:
    other = ss[free[0]]
    done = threading.Event()
    t0 = time.perf_counter()

    def other_launch():
      launch(mark, other, np.uint64(ptr + 4 * BMARK), np.uint32(1))
      done.set()
    threading.Thread(target=other_launch, daemon=True).start()
    returned = done.wait(wait_s)
    depth["other_launch_returned"] = returned
    depth["other_launch_ms"] = round((time.perf_counter() - t0) * 1e3, 3) if returned else None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and w[BMARK] == 0:
      time.sleep(0.005)
    depth["other_kernel_ran"] = bool(w[BMARK])
  w[FLAG] = 1
  filler.join(spin_s + 5)
  for s in ss:
    s.synchronize()
  depth["spin"] = {1: "released", 2: "timed out"}.get(w[RESULT], "not run")
  depth["filled_total"] = count[0]
  out["depth"] = depth
  cp.cuda.runtime.freeHost(ptr)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--streams", type=int, default=40)
  ap.add_argument("--wait-s", type=float, default=0.5, help="how long a kernel that could run may take to run")
  ap.add_argument("--spin-s", type=float, default=5.0, help="the spinning kernel gives up after this")
  ap.add_argument("--depth-max", type=int, default=20000)
  ap.add_argument("--connections", default="", help="comma-separated CUDA_DEVICE_MAX_CONNECTIONS values, one child each")
  ap.add_argument("--json", default="")
  a = ap.parse_args()
  if a.connections:
    results = []
    for c in a.connections.split(","):
      env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS=c)
      cmd = [sys.executable, __file__, "--streams", str(a.streams), "--wait-s", str(a.wait_s), "--spin-s",
             str(a.spin_s), "--depth-max", str(a.depth_max), "--json", "-"]
      r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
      try:
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
      except (IndexError, json.JSONDecodeError):
        results.append({"connections": c, "error": (r.stderr or r.stdout)[-2000:]})
  else:
    results = [probe(a.streams, a.wait_s, a.spin_s, a.depth_max)]
  doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv), "runs": results}
  text = json.dumps(doc if a.json != "-" else results[0])
  if a.json and a.json != "-":
    with open(a.json, "w") as f:
      f.write(json.dumps(doc, indent=1) + "\n")
  print(text)


if __name__ == "__main__":
  main()
