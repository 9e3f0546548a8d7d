"""The fused overlap GEMM alone on one GPU, against XLA's dot (cuBLAS).

The per-rank GEMMs of benchmarks/overlap.py (TP=2 Megatron shards: AG+GEMM
(M, K) @ (K, N/2), GEMM+RS (M, K/2) @ (K/2, N)), bfloat16, ms per op:

  xla_dot     jnp.dot under jax.jit (what t_gemm measures in overlap.py)
  fused_1x1   the fused kernel of xla_ffi/overlap over a one-GPU axis (a group
              of one rank: no communication, the GEMM with its scheduler and
              epilogue), one CTA per tile
  fused_2x1   the same with jax_dfccl.config.overlap_cluster_m = 2 (pairs of
              tiles on 2x1 clusters, the weight tile multicast to both)

Timing as in overlap.py (a chain of dependent ops per program, programs
called back to back, median over reps).  Needs one sm90 GPU.

  python benchmarks/overlap_gemm.py --tag h200 --outdir $OUT
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

VARIANTS = ["xla_dot", "fused_1x1", "fused_2x1"]


def build(kind, M, N, K, names, iters):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import Mesh, PartitionSpec as P

  from jax_dfccl._src import overlap_gpu as og
  from jax_dfccl.config import config

  m, n, k = (M, N // 2, K) if kind == "ag" else (M, N, K // 2)
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
  mesh = Mesh(np.array(jax.devices()[:1]), ("one",))

  def chain(body):
    def f(x, w):
      ys = []
      for _ in range(iters):
        y = body(x, w)
        x, y = lax.optimization_barrier((x, y))  # op i+1 starts after op i ends
        ys.append(y)
      return tuple(ys)
    return f

  def fused(cluster_m):
    if kind == "ag":
      body = lambda x, w: og.all_gather_matmul(x, w, "one", 1)[0]  # noqa: E731
    else:
      body = lambda x, w: og.matmul_reduce_scatter(x, w, "one", 1)  # noqa: E731
    f = jax.jit(jax.shard_map(chain(body), mesh=mesh, in_specs=(P(), P()), out_specs=(P(),) * iters))
    old, config.overlap_cluster_m = config.overlap_cluster_m, cluster_m
    try:
      if "dfccl_overlap_" not in f.lower(x, w).as_text():
        raise RuntimeError("fused kernel not used")
      return f.lower(x, w).compile(), (x, w)
    finally:
      config.overlap_cluster_m = old

  makers = {"xla_dot": lambda: (jax.jit(chain(jnp.dot)), (x, w)),
            "fused_1x1": lambda: fused(1), "fused_2x1": lambda: fused(2)}
  return {v: makers[v] for v in names}, (m, n, k)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--ops", default="ag,rs", type=lambda s: s.split(","))
  p.add_argument("--m", default=[1024, 4096, 8192], type=lambda s: [int(v) for v in s.split(",")])
  p.add_argument("--nk", default=[0, 1, 2], type=lambda s: [int(v) for v in s.split(",")])
  p.add_argument("--variants", default=VARIANTS, type=lambda s: s.split(","))
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--min-rep-ms", type=float, default=30.0)
  p.add_argument("--tag", default="local")
  p.add_argument("--outdir", default=None, help="default benchmarks/results")
  args = p.parse_args()
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path.insert(0, os.path.join(here, ".."))
  sys.path.insert(0, here)
  import jax

  from overlap import AG_NK, RS_NK, plan, time_per_op

  rows = []
  for i in args.nk:
    for M in args.m:
      for kind in args.ops:
        N, K = (AG_NK if kind == "ag" else RS_NK)[i]
        iters, _ = plan(kind, M, N, K)
        makers, (m, n, k) = build(kind, M, N, K, args.variants, iters)
        row = {"kind": kind, "M": M, "N": N, "K": K, "gemm": [m, n, k], "ms": {}, "tflops": {}}
        for v, make in makers.items():
          try:
            f, a = make()
            ms, _ = time_per_op(f, a, iters, args.reps, args.min_rep_ms / 1e3)
            row["ms"][v], row["tflops"][v] = ms, 2 * m * n * k / (ms * 1e-3) / 1e12
          except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
            row["ms"][v] = None
            row.setdefault("errors", {})[v] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
  now = dt.datetime.now(dt.timezone.utc)
  dev = jax.devices()[0]
  meta = {"date": now.isoformat(timespec="seconds"), "device": getattr(dev, "device_kind", str(dev)),
          "jax": jax.__version__, "command": "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:])}
  outdir = args.outdir or os.path.join(here, "results")
  os.makedirs(outdir, exist_ok=True)
  base = os.path.join(outdir, f"overlap_gemm_{now:%Y-%m-%d}_{args.tag}")
  with open(base + ".json", "w") as fh:
    json.dump({"meta": meta, "rows": rows}, fh, indent=1)
  lines = [f"# Fused overlap GEMM alone vs XLA dot ({meta['device']}, {meta['date']})", "",
           f"`{meta['command']}` (jax {meta['jax']}); ms per op (TFLOP/s), bfloat16, per-rank GEMM of TP=2.", "",
           "| op | M | N | K | GEMM m x n x k | " + " | ".join(args.variants) + " |",
           "|---|---|---|---|---|" + "---|" * len(args.variants)]
  for r in rows:
    cells = [f"{r['ms'][v]:.3f} ({r['tflops'][v]:.0f})" if r["ms"].get(v) else "err" for v in args.variants]
    lines.append(f"| {r['kind']} | {r['M']} | {r['N']} | {r['K']} | {'x'.join(map(str, r['gemm']))} | "
                 + " | ".join(cells) + " |")
  with open(base + ".md", "w") as fh:
    fh.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
