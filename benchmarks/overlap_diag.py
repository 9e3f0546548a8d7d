"""Where the fused overlap kernels' time goes (GPU, 2 devices, bfloat16).

Per LLaMA TP=2 shape (global sizes, as in benchmarks/overlap.py) it reports, in
ms per op:

  xla_dot        XLA's dot of the per-rank GEMM shape on one GPU (honest chain)
  fused_wall     the fused op in a jitted chain of ITERS ops, wall clock
  fused_kernel   CUDA-event time of the fused GEMM kernel (median over calls)
  push_kernel    AG: CUDA-event time of the push kernel (side stream)
  nocomm_wall    fused chain with the no_comm diagnostic: no waits, no remote
                 stores, no push (the kernel's GEMM alone; results invalid)
  nocomm_kernel  CUDA-event time of that GEMM kernel
  *_host         host time of one custom-call handler (median)

fused_kernel - nocomm_kernel is the communication cost the overlap did not hide;
nocomm_kernel / xla_dot is our GEMM's efficiency; fused_wall - fused_kernel is
host / launch cost.

  python benchmarks/overlap_diag.py [--m 1024,4096] [--iters 5] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def chain(body, iters):
  from jax import lax

  def f(x, w):
    ys = []
    for _ in range(iters):
      y = body(x, w)
      x, y = lax.optimization_barrier((x, y))
      ys.append(y)
    return tuple(ys)
  return f


def run_shape(kind, M, N, K, iters, reps):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from common import median_time
  from jax_dfccl._src import overlap as ov
  from jax_dfccl._src import overlap_gpu as og

  mod = og.module()
  mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
  bf = jnp.bfloat16
  if kind == "ag":
    xs, ws, os_, op = P("tp", None), P(None, "tp"), P(None, "tp"), ov.all_gather_matmul
    gm, gn, gk = M, N // 2, K
  else:
    xs, ws, os_, op = P(None, "tp"), P("tp", None), P("tp", None), ov.matmul_reduce_scatter
    gm, gn, gk = M, N, K // 2
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
  x = put(jnp.ones((M, K), bf), xs)
  w = put(jnp.ones((K, N), bf) * 0.01, ws)
  r = {"shape": [kind, M, N, K], "gemm_per_rank": [gm, gn, gk]}

  d0 = jax.devices()[0]
  a = jax.device_put(jnp.ones((gm, gk), bf), d0)
  b = jax.device_put(jnp.ones((gk, gn), bf), d0)
  r["xla_dot"] = median_time(jax.jit(chain(lambda x, w: x @ w, iters)), a, b, reps=reps) / iters * 1e3

  with og.fused(True):
    f = jax.jit(jax.shard_map(chain(lambda x, w: op(x, w, "tp"), iters), mesh=mesh,
                              in_specs=(xs, ws), out_specs=(os_,) * iters))
    f.lower(x, w)
  for mode, no_comm in (("fused", False), ("nocomm", True)):
    mod._set_diag(no_comm, False)
    r[mode + "_wall"] = median_time(f, x, w, reps=reps) / iters * 1e3
    mod._set_diag(no_comm, True)
    jax.block_until_ready(f(x, w))
    jax.block_until_ready(f(x, w))
    mod._set_diag(False, False)
    res = mod._profile_results()
    g = [ms for k, ms in res if k.endswith("|gemm_nocomm" if no_comm else "|gemm") and ms >= 0]
    r[mode + "_kernel"] = statistics.median(g) if g else None
    h = [ms for k, ms in res if k.endswith("|host") and ms >= 0]
    r[mode + "_host"] = statistics.median(h) if h else None
    if not no_comm and kind == "ag":
      p = [ms for k, ms in res if k.endswith("|push") and ms >= 0]
      r["push_kernel"] = statistics.median(p) if p else None
  tf = 2 * gm * gn * gk / 1e9
  for k in ("xla_dot", "fused_kernel", "nocomm_kernel"):
    if r.get(k):
      r[k + "_tflops"] = round(tf / r[k], 1)
  og.check()
  jax.clear_caches()
  return r


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--m", default=[1024, 4096], type=lambda s: [int(v) for v in s.split(",")])
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--out", default=None, help="JSON lines file")
  args = p.parse_args()
  for m in args.m:
    for s in (("ag", m, 14336, 4096), ("rs", m, 4096, 14336)):
      try:
        r = run_shape(*s, args.iters, args.reps)
      except Exception as e:  # noqa: BLE001
        r = {"shape": list(s), "error": f"{type(e).__name__}: {str(e)[:400]}"}
      line = json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
      print(line, flush=True)
      if args.out:
        with open(args.out, "a") as f:
          f.write(line + "\n")


if __name__ == "__main__":
  main()
