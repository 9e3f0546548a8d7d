"""Which GPU kernels run for bfloat16 GEMMs, with their times: XLA's (jnp.dot under jax.jit)
or, with --fused 1|2, the fused overlap GEMM over a one-GPU axis (1x1 or 2x1 clusters).

For each (m, n, k) given, runs a jitted dot a few times under jax.profiler,
then reads the trace (perfetto JSON) and prints every kernel's name with its
median duration -- e.g. the cuBLAS kernel's tile size and cluster shape, to
compare with the fused overlap GEMM (benchmarks/overlap_gemm.py).

  python tools/xla_gemm_kernels.py 1024x4096x7168 1024x7168x4096 [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from common import gpu_kernel_events  # noqa: E402


def _fused(cluster_m):
  """The fused GEMM+RS op over a one-GPU axis (no communication), traced with overlap_cluster_m."""
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P

  import jax_dfccl
  from jax_dfccl._src import overlap_gpu as og
  mesh = Mesh(np.array(jax.devices()[:1]), ("one",))
  f = jax.jit(jax.shard_map(lambda x, w: og.matmul_reduce_scatter(x, w, "one", 1), mesh=mesh,
                            in_specs=(P(), P()), out_specs=P()))

  def run(x, w):  # the first call traces (under the setting); later ones reuse it
    with jax_dfccl.configured(overlap_cluster_m=cluster_m):
      return f(x, w)
  return run


def main():
  p = argparse.ArgumentParser()
  p.add_argument("shapes", nargs="+", help="m x n x k, e.g. 1024x4096x7168")
  p.add_argument("--out", default=None, help="where the traces go (default: a temporary folder)")
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--fused", type=int, default=0, choices=(0, 1, 2),
                 help="the fused overlap GEMM (GEMM+RS kind, one rank) with this cluster size instead of jnp.dot")
  a = p.parse_args()
  for s in a.shapes:
    m, n, k = (int(v) for v in s.split("x"))
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.bfloat16)
    f = jax.jit(jnp.dot) if not a.fused else _fused(a.fused)
    jax.block_until_ready(f(x, w))
    d = os.path.join(a.out or tempfile.mkdtemp(), f"trace_{s}")
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(a.calls):
        y = f(x, w)
      jax.block_until_ready(y)
    times = collections.defaultdict(list)
    for name, _, dur in gpu_kernel_events(d):
      times[name].append(dur)
    print(f"{s}: {2 * m * n * k / 1e12:.3f} TFLOP per dot", flush=True)
    for name, ds in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
      med = statistics.median(ds)
      print(f"  {med:9.1f} us  x{len(ds):3d}  {2 * m * n * k / (med * 1e-6) / 1e12:6.0f} TFLOP/s  {name[:200]}",
            flush=True)


if __name__ == "__main__":
  main()
