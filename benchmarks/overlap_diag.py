"""Where the fused overlap kernels' time goes (GPU, 2 devices, bfloat16).

Per LLaMA TP=2 shape (global sizes, as in benchmarks/overlap.py) it reports, in
ms per op:

  xla_dot        XLA's dot of the per-rank GEMM shape on one GPU (honest chain)
  fused_wall     the fused op in a jitted chain of ITERS ops, wall clock
                 (default config: AG rows by the copy engine, RS one fence per
                 CTA; legacy_*: the same with overlap_copy_engine=False and
                 overlap_cta_fence=False, the first version's SM push kernel and
                 per-thread fences; rs_ce_*: RS with overlap_rs_copy_engine_min_bytes=0)
  fused_kernel   CUDA-event time of the fused GEMM kernel (median over calls)
  push_kernel    AG: CUDA-event time of the side stream's row transfer (SM push
                 kernel or copy engine: ready wait + copy + signal)
  tl             fused: medians of the device timeline summaries (ms; see
                 Summarize in xla_ffi/overlap/handlers.cc): span, mma_avg,
                 cwait_per_cta / pwait_per_cta (time blocked on the peer per
                 CTA), wait_max, epi_own_avg / epi_peer_avg, own_done /
                 peer_done, first_rows, ready_wait / ready_at / copy / signal_at,
                 rank_skew (median |first tile start of rank 0 - rank 1|)
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

  from jax_dfccl.config import config

  def build(**cfg):  # the transfer / fence scheme is read at trace time
    old = {k: getattr(config, k) for k in cfg}
    try:
      for k, v in cfg.items():
        setattr(config, k, v)
      with og.fused(True):
        f = jax.jit(jax.shard_map(chain(lambda x, w: op(x, w, "tp"), iters), mesh=mesh,
                                  in_specs=(xs, ws), out_specs=(os_,) * iters))
        f.lower(x, w)
    finally:
      for k, v in old.items():
        setattr(config, k, v)
    return f

  fused_f = build()
  legacy_f = build(overlap_copy_engine=False, overlap_cta_fence=False, overlap_rs_copy_engine_min_bytes=-1)
  variants = [("fused", False, fused_f), ("legacy", False, legacy_f), ("nocomm", True, fused_f)]
  if kind == "rs":
    variants.insert(2, ("rs_ce", False, build(overlap_rs_copy_engine_min_bytes=0)))
  for mode, no_comm, f in variants:
    pre = "" if mode == "fused" else mode + "_"
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
      p = [ms for k, ms in res if (k.endswith("|push") or k.endswith("|copy")) and ms >= 0]
      r[pre + "push_kernel"] = statistics.median(p) if p else None
    if not no_comm:
      tl = {}
      for k, ms in res:
        if "|tl_" in k:
          tl.setdefault(k.split("|tl_", 1)[1], []).append(ms)
      r[pre + "tl"] = tl_med = {k: round(statistics.median(v), 4) for k, v in tl.items()
                                if not k.startswith("start_r")}
      s0, s1 = tl.get("start_r0", []), tl.get("start_r1", [])
      skew = [abs(a - b) for a, b in zip(s0, s1) if abs(a - b) < 500]  # same call of both ranks
      if skew:  # |start of rank 0 - start of rank 1| (globaltimer; host-synchronized clocks)
        tl_med["rank_skew"] = round(statistics.median(skew), 4)
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
