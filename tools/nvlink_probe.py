"""What the links between GPU 0 and GPU 1 carry, measured the three ways a
collective can move data: SM stores into the peer (push), SM loads from the
peer (pull), and the copy engine (cudaMemcpyPeerAsync); both directions at once,
as in a 2-rank collective.  Needs CuPy.  Usage: python tools/nvlink_probe.py
"""
from __future__ import annotations

import cupy as cp

SRC = r"""
extern "C" __global__ void copy16(const uint4* __restrict__ s, uint4* __restrict__ d, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    d[i] = __ldcg(s + i);
}
"""
NBYTES = 512 << 20


def run(kind, blocks, reps=5):
  devs = (0, 1)
  bufs, streams, kern = {}, {}, {}
  for d in devs:
    with cp.cuda.Device(d):
      bufs[d] = (cp.ones(NBYTES // 4, cp.float32), cp.zeros(NBYTES // 4, cp.float32))
      streams[d] = cp.cuda.Stream(non_blocking=True)
      kern[d] = cp.RawKernel(SRC, "copy16")
  for d in devs:
    with cp.cuda.Device(d):
      try:
        cp.cuda.runtime.deviceEnablePeerAccess(1 - d)
      except cp.cuda.runtime.CUDARuntimeError:
        pass
  n16 = NBYTES // 16
  times = []
  for _ in range(reps):
    ev = {}
    for d in devs:
      with cp.cuda.Device(d):
        ev[d] = (cp.cuda.Event(), cp.cuda.Event())
        ev[d][0].record(streams[d])
    for d in devs:
      p = 1 - d
      with cp.cuda.Device(d):
        if kind == "push":    # my SMs store into the peer's buffer
          kern[d]((blocks,), (512,), (bufs[d][0], bufs[p][1], cp.int64(n16)), stream=streams[d])
        elif kind == "pull":  # my SMs load from the peer's buffer
          kern[d]((blocks,), (512,), (bufs[p][0], bufs[d][1], cp.int64(n16)), stream=streams[d])
        else:                 # copy engine, peer -> me
          cp.cuda.runtime.memcpyPeerAsync(bufs[d][1].data.ptr, d, bufs[p][0].data.ptr, p, NBYTES, streams[d].ptr)
    for d in devs:
      with cp.cuda.Device(d):
        ev[d][1].record(streams[d])
    for d in devs:
      ev[d][1].synchronize()
    times.append(max(cp.cuda.get_elapsed_time(*ev[d]) for d in devs) / 1e3)
  t = sorted(times)[len(times) // 2]
  return NBYTES / t / 1e9


def main():
  print(f"each GPU moves {NBYTES >> 20} MiB from/to the other, both directions at once; GB/s per direction")
  print(f"copy engine: {run('ce', 0):.0f}")
  for blocks in (16, 32, 48, 64, 132):
    print(f"{blocks:4d} blocks x 512 threads: push {run('push', blocks):.0f}  pull {run('pull', blocks):.0f}", flush=True)


if __name__ == "__main__":
  main()
