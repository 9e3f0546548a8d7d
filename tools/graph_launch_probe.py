"""What does the host pay to launch a CUDA graph shaped like XLA's command buffer of a collective chain?

XLA records a jax_dfccl collective inside a command buffer by capturing its handler on a
stream: the collective becomes a child-graph node holding one kernel, between XLA's own kernel
nodes.  A chain of 100 collectives is one graph of about 200 nodes, and in a profile of the
two-process testbed its cuGraphLaunch took 210-510 us on the host per execution: more than the
device time of the ops on some runs, so the host, not the device, set the pace.  This probe
separates the causes on a bare GPU (no JAX): the host time of one cuGraphLaunch and the device
time per launch (launches back to back) for graphs of
  kernels     2N kernel nodes in a line (tiny kernels, 8-byte parameters);
  children    N child-graph nodes (one kernel each) alternating with N kernel nodes;
  bigparams   2N kernel nodes whose parameter is a 320-byte struct (a submit kernel's size).
Run it alone and inside tools/mps_testbed.sh (one or two processes) to see what MPS adds.
Needs CuPy and cuda-bindings.

  python tools/graph_launch_probe.py [--n 100] [--launches 200] [--json FILE]
"""
import argparse
import ctypes
import json
import os
import statistics
import time

SRC = r'''
struct Big { unsigned long long v[40]; };
extern "C" __global__ void tiny(float* x) { if (threadIdx.x == 0) x[0] += 1.0f; }
extern "C" __global__ void tiny_big(float* x, Big b) { if (threadIdx.x == 0) x[0] += (float)(b.v[0] & 1); }
'''


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--n", type=int, default=100, help="collectives per graph (nodes: 2n)")
  ap.add_argument("--launches", type=int, default=200)
  ap.add_argument("--json", default=None)
  a = ap.parse_args()
  import cupy as cp
  from cuda.bindings import driver as cu

  def ok(r):
    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
      raise RuntimeError(f"CUDA driver error {err}")
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r

  cp.cuda.Device(0).use()
  mod = cp.RawModule(code=SRC)
  f_tiny = cu.CUfunction(mod.get_function("tiny").kernel.ptr)  # (RawKernel.kernel: the loaded CUfunction)
  f_big = cu.CUfunction(mod.get_function("tiny_big").kernel.ptr)
  x = cp.zeros(1, cp.float32)
  xptr = ctypes.c_void_p(x.data.ptr)
  big = (ctypes.c_ulonglong * 40)(*range(40))
  args_tiny = (ctypes.c_void_p * 1)(ctypes.addressof(xptr))
  args_big = (ctypes.c_void_p * 2)(ctypes.addressof(xptr), ctypes.addressof(big))

  def kparams(fn, args):
    p = cu.CUDA_KERNEL_NODE_PARAMS()
    p.func = fn
    p.gridDimX, p.gridDimY, p.gridDimZ = 1, 1, 1
    p.blockDimX, p.blockDimY, p.blockDimZ = 32, 1, 1
    p.sharedMemBytes = 0
    p.kernelParams = ctypes.addressof(args)
    return p

  def add_kernel(g, deps, fn=f_tiny, args=args_tiny):
    return ok(cu.cuGraphAddKernelNode(g, deps, len(deps), kparams(fn, args)))

  def build(kind):
    g = ok(cu.cuGraphCreate(0))
    last = []
    for _ in range(a.n):
      if kind == "children":
        child = ok(cu.cuGraphCreate(0))
        add_kernel(child, [])
        node = ok(cu.cuGraphAddChildGraphNode(g, last, len(last), child))
      elif kind == "bigparams":
        node = add_kernel(g, last, f_big, args_big)
      else:
        node = add_kernel(g, last)
      last = [add_kernel(g, [node])]
    return ok(cu.cuGraphInstantiate(g, 0))

  stream = cp.cuda.Stream(non_blocking=True)
  s = cu.CUstream(stream.ptr)
  out = {"n": a.n, "nodes": 2 * a.n, "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "pid": os.getpid()}
  for kind in ("kernels", "children", "bigparams"):
    ge = build(kind)
    for _ in range(5):
      ok(cu.cuGraphLaunch(ge, s))
    stream.synchronize()
    host = []
    for i in range(a.launches):
      t = time.perf_counter()
      ok(cu.cuGraphLaunch(ge, s))
      host.append((time.perf_counter() - t) * 1e6)
      if i % 8 == 7:
        stream.synchronize()
    stream.synchronize()
    t = time.perf_counter()
    for _ in range(50):
      ok(cu.cuGraphLaunch(ge, s))
    stream.synchronize()
    per = (time.perf_counter() - t) / 50 * 1e6
    out[kind] = {"launch_host_us_median": statistics.median(host), "launch_host_us_p90": sorted(host)[int(0.9 * len(host))],
                 "per_launch_back_to_back_us": per, "per_node_back_to_back_us": per / (2 * a.n)}
    print(f"{kind:10s} cuGraphLaunch host {out[kind]['launch_host_us_median']:8.1f} us (p90 "
          f"{out[kind]['launch_host_us_p90']:.1f}); back to back {per:8.1f} us per launch, "
          f"{per / (2 * a.n):.2f} us per node", flush=True)
  print("RESULT " + json.dumps(out), flush=True)
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  main()
