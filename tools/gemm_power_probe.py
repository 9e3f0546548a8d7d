"""Steady-state GEMM rate, SM clock and board power: XLA's dot against the fused overlap GEMM.

For one bf16 shape (m x n x k), each implementation runs back to back for
--seconds, in turns (A B A B ...), while `nvidia-smi` samples the SM clock and
the board power every 50 ms.  Per implementation: TFLOP/s, median SM clock,
median power, and TFLOP/s per GHz of SM clock -- so a slower kernel can be told
apart as less work per clock (the kernel) or fewer clocks (the power limit).

  python tools/gemm_power_probe.py 8192x24576x12288 --impls xla,t128,t256 [--seconds 3] [--json OUT]
         [--chain 8] [--trace DIR]
  ncu --clock-control none --kernel-name regex:nvjet --launch-skip 2 --launch-count 1 \
      python tools/gemm_power_probe.py 4096x7168x4096 --impls xla,t256 --once

--chain N puts N dependent GEMMs in each program (benchmarks/overlap.py's
chain, as benchmarks/overlap_gemm.py times them; times are per GEMM).  --trace
DIR then traces (jax.profiler) 3 programs of each implementation right after
its timed turn, in that steady state, and reports the GEMM kernel's median
duration and start-to-start period there, so a slower rate can be told apart as
a slower kernel or as gaps between kernels.

Implementations: `xla` (jnp.dot under jax.jit), `tN` (the fused GEMM+RS op over
a one-GPU axis with jax_dfccl.config.overlap.tile_n = N), `auto` (its default
tile choice); a suffix `-nopdl` turns the programmatic launch off
(jax_dfccl.config.overlap.pdl = False).  Needs one GPU and nvidia-smi.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np


def _impl(name, x, w, chain=0):
  """The jitted implementation: f(x, w) -> one result (chain > 0: a tuple of `chain` dependent results)."""
  wrap = (lambda body: body) if chain <= 0 else (lambda body: _chain(body, chain))
  if name == "xla":
    return jax.jit(wrap(jnp.dot))
  from jax.sharding import Mesh, PartitionSpec as P

  import jax_dfccl
  from jax_dfccl._src import overlap_gpu as og
  base, _, opt = name.partition("-")
  tile_n = 0 if base == "auto" else int(base[1:])
  mesh = Mesh(np.array(jax.devices()[:1]), ("one",))
  f = jax.jit(jax.shard_map(wrap(lambda x, w: og.matmul_reduce_scatter(x, w, "one", 1)), mesh=mesh,
                            in_specs=(P(), P()), out_specs=P() if chain <= 0 else (P(),) * chain))
  with jax_dfccl.configured(overlap_tile_n=tile_n, overlap_pdl=opt != "nopdl"):
    return f.lower(x, w).compile()


def _benchmarks():
  """Puts benchmarks/ on sys.path (its overlap.py and overlap_gemm.py)."""
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))


def _chain(body, n):
  _benchmarks()
  from overlap import chain
  return chain(body, n)


def _steady_trace(f, x, w, calls, trace_dir):
  """The GEMM kernel's median duration and start-to-start period (us) over 3 traced programs after `calls`
  untimed (benchmarks/overlap_gemm.py gemm_kernel_stats)."""
  _benchmarks()
  from common import gpu_kernel_events
  from overlap_gemm import gemm_kernel_stats
  y = None
  for _ in range(calls):
    y = f(x, w)
  with jax.profiler.trace(trace_dir):  # starts while the untimed programs still run: steady state throughout
    for _ in range(3):
      y = f(x, w)
    jax.block_until_ready(y)
  return gemm_kernel_stats(gpu_kernel_events(trace_dir))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("shape")
  p.add_argument("--impls", default="xla,auto", type=lambda s: s.split(","))
  p.add_argument("--seconds", type=float, default=3.0)
  p.add_argument("--turns", type=int, default=2)
  p.add_argument("--json", default=None)
  p.add_argument("--chain", type=int, default=0, help="dependent GEMMs per program (0: one, not chained)")
  p.add_argument("--trace", default=None, help="folder for the steady-state traces (see the docstring)")
  p.add_argument("--once", action="store_true",
                 help="only call each implementation 3 times (for a profiler: ncu --kernel-name ... )")
  a = p.parse_args()
  m, n, k = (int(v) for v in a.shape.split("x"))
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
  fns = {i: _impl(i, x, w, a.chain) for i in a.impls}
  per_prog = max(1, a.chain)
  if a.once:
    for f in fns.values():
      jax.block_until_ready([f(x, w) for _ in range(3)])
    return
  per_call = {}
  for i, f in fns.items():
    jax.block_until_ready(f(x, w))
    t = time.perf_counter()
    for _ in range(5):
      y = f(x, w)
    jax.block_until_ready(y)
    per_call[i] = (time.perf_counter() - t) / 5
  traces = {}
  smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                          "-lms", "50"], stdout=subprocess.PIPE, text=True)
  samples = []  # (time, SM MHz, W), appended by the reader until nvidia-smi ends

  def read():
    for line in smi.stdout:
      try:
        clk, pw = (float(v) for v in line.split(","))
      except ValueError:
        continue
      samples.append((time.time(), clk, pw))
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  segs = {i: [] for i in fns}
  for _ in range(a.turns):
    for i, f in fns.items():
      calls = max(4, int(a.seconds / per_call[i]))
      t0w, t0 = time.time(), time.perf_counter()
      y = None
      for _ in range(calls):  # a device runs its programs in order: the last one ends last
        y = f(x, w)  # (only the last result is kept: hundreds of outputs would not fit)
      jax.block_until_ready(y)
      dt = time.perf_counter() - t0
      segs[i].append((t0w + 0.3 * dt, t0w + dt, dt / (calls * per_prog)))  # clocks settle over the first 30%
      if a.trace and i not in traces:
        traces[i] = _steady_trace(f, x, w, calls // 4, f"{a.trace}/{i}")
  time.sleep(0.2)
  smi.terminate()
  reader.join(timeout=2)
  flop = 2 * m * n * k
  out = {"shape": [m, n, k], "impls": {}}
  for i, ss in segs.items():
    clk = [c for t0, t1, _ in ss for (t, c, _p) in samples if t0 <= t <= t1]
    pw = [q for t0, t1, _ in ss for (t, _c, q) in samples if t0 <= t <= t1]
    ms = statistics.median(s[2] for s in ss) * 1e3
    tf = flop / (ms * 1e-3) / 1e12
    ghz = statistics.median(clk) / 1e3 if clk else float("nan")
    out["impls"][i] = {"ms": ms, "tflops": tf, "sm_ghz": ghz, "power_w": statistics.median(pw) if pw else None,
                       "tflops_per_ghz": tf / ghz, "samples": len(clk), "chain": a.chain,
                       "steady_trace": traces.get(i)}
    print(f"{a.shape} {i:5s} {ms:8.3f} ms  {tf:6.0f} TFLOP/s  SM {ghz:5.3f} GHz  "
          f"{out['impls'][i]['power_w']} W  {tf / ghz:6.1f} TFLOP/s per GHz  ({len(clk)} samples)"
          f"  trace {traces.get(i)}", flush=True)
  if a.json:
    with open(a.json, "a") as fh:
      fh.write(json.dumps(out) + "\n")


if __name__ == "__main__":
  main()
