"""Do independent CUDA streams block each other through shared hardware work queues?

It creates 40 non-blocking streams on GPU 0; for every j = 1 .. 39, with A = stream 0
and B = stream j, it enqueues on A a one-block kernel that spins for SPIN_S seconds
followed by a second kernel (which must wait for the first: an in-stream
dependency), then on B a small device-to-device copy, and measures when B's copy
completes.  Independent queues: B finishes in well under a millisecond; a queue
shared with A: B waits behind A's second kernel, i.e. ~SPIN_S.  The copy-engine
path and the daemon rely on side streams making progress while an XLA stream spins
in a wait kernel; this shows for which stream counts that holds (run it with the
default and with CUDA_DEVICE_MAX_CONNECTIONS=32).  Needs CuPy.
Usage: python tools/queue_probe.py
"""
from __future__ import annotations

import os
import time

import cupy as cp

SPIN_S = 0.3
SRC = r"""
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
extern "C" __global__ void touch(int* p) { p[0] += 1; }
"""


def trial(a, b, kern, buf):
  done = cp.cuda.Event()
  with a:  # RawKernel launches go to the current stream
    kern["spin"]((1,), (1,), (cp.uint64(int(SPIN_S * 1e9)),))
    kern["touch"]((1,), (1,), (buf[0],))
  t0 = time.perf_counter()
  cp.cuda.runtime.memcpyAsync(buf[1].data.ptr, buf[2].data.ptr, buf[1].nbytes,
                              cp.cuda.runtime.memcpyDeviceToDevice, b.ptr)
  done.record(b)
  while not done.done:
    time.sleep(1e-5)
  t_b = time.perf_counter() - t0
  a.synchronize()
  return t_b


def main():
  print("CUDA_DEVICE_MAX_CONNECTIONS =", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "(default)"), flush=True)
  with cp.cuda.Device(0):
    mod = cp.RawModule(code=SRC)
    kern = {n: mod.get_function(n) for n in ("spin", "touch")}
    buf = (cp.zeros(1, cp.int32), cp.zeros(1 << 20, cp.float32), cp.ones(1 << 20, cp.float32))
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(40)]
    trial(streams[0], streams[1], kern, buf)  # warm-up: module load, first launches
    blocked = []
    for j in range(1, len(streams)):
      t = trial(streams[0], streams[j], kern, buf)
      if t > SPIN_S / 2:
        blocked.append(j)
      print(f"B = stream {j:2d}: its copy done after {t * 1e3:8.2f} ms{'  BLOCKED behind A' if t > SPIN_S / 2 else ''}",
            flush=True)
    print("streams blocked behind stream 0:", blocked or "none", flush=True)


if __name__ == "__main__":
  main()
