"""Where the time of a small collective goes, from the daemon's trace.

Runs an unrolled chain of psums of one small size with tracing on and prints,
per device, medians (means) over the chain of:
  between   XLA's stream from seeing collective i-1 done to reaching the done wait
            of collective i (its other work, the ready write of i)
  pickup    from there to the daemon running i
  exchange  the daemon's run -> finish of i (includes waiting for the peer)
  wake      finish of i -> XLA's stream seeing it
and the per-op time with tracing off, and the host-side handler times.  Usage: python tools/latency_probe.py [bytes]
`--bw`: per-op time, busbw and the daemon's exchange time (run -> finish) of
large psum / all_gather chains under a few GPU runtime settings.
`--crossover`: marginal per-op time of psum / all_gather / psum_scatter chains from
1 to 64 MiB on the daemon and on the copy-engine path (config.tuning.copy_engine_min_bytes).
`--large`: large all_gather / psum chains (64 MiB .. 1 GiB) on the copy engines, unrolled and in fori_loop,
wall time per op next to the copy-engine GPU time per op (first copy .. done write on
rank 0, from stats()), and one all_gather per size checked against numpy on every rank.
"""
from __future__ import annotations

import pathlib
import statistics as st
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jax_dfccl as dfccl
from jax_dfccl import trace

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402  (benchmarks/common.py: median wall-clock time of a jitted call)

N = len(jax.devices())
MESH = Mesh(np.array(jax.devices()), ("x",))
NOPS = 100


def chain(nops, op=lambda y: dfccl.psum(y, "x") * 0.5):
  """A jitted unrolled chain of `nops` dependent collectives `op`."""
  def body(v):
    y = v[0]
    for _ in range(nops):
      y = op(y)
    return y[None]
  return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=P("x"), check_vma=False))


def per_op_us(f, x):
  return common.median_time(f, x, reps=20, warmup=1) / NOPS * 1e6


def breakdown(recs, label=""):
  """Per device, medians (means) over consecutive instances, from the trace."""
  ev = {}  # (dev, key, seq) -> {event: first t}
  last = {}
  for _plat, dev, key, seq, name, t in recs:
    ev.setdefault((dev, key, seq), {}).setdefault(name, t)
    last[(dev, key)] = max(last.get((dev, key), 0), seq)
  ev = {k: e for k, e in ev.items() if k[2] == last[(k[0], k[1])]}  # the latest run of each collective
  parts = {"between": ("stream_woke", "stream_wait", True), "pickup": ("stream_wait", "run", False),
           "exchange": ("run", "finish", False), "wake": ("finish", "stream_woke", False)}
  for dev in sorted({k[0] for k in ev}):
    inst = sorted((e for k, e in ev.items() if k[0] == dev and "start" in e), key=lambda e: e["start"])
    out = []
    for name, (a, b, prev) in parts.items():
      vals = [(eb[b] - (ea if prev else eb)[a]) / 1e3 for ea, eb in zip(inst, inst[1:])
              if a in (ea if prev else eb) and b in eb]
      if vals:
        out.append(f"{name} {st.median(vals):.1f} ({st.mean(vals):.1f})")
    print(f"  {label}device {dev}: " + ", ".join(out) + f" us  [median (mean), n={len(inst)}]", flush=True)


def bandwidth(settings):
  from jax_dfccl._src import backend
  rt = backend.load()["cuda"]
  rt.configure(settings)  # before the first collective: pool geometry applies to new communicators
  ops = {"psum": lambda y: dfccl.psum(y, "x") * 0.5,
         "all_gather": lambda y: dfccl.all_gather(y, "x", tiled=True)[: y.shape[0]]}

  def seconds(f, x):
    return common.median_time(f, x, reps=5, warmup=1)

  for nbytes in (16 << 20, 1024 << 20):
    x = jnp.ones((N, nbytes // 2), jnp.bfloat16)
    for name, op in ops.items():
      f2, f10 = chain(2, op), chain(10, op)
      t2, t10 = seconds(f2, x), seconds(f10, x)
      t = (t10 - t2) / 8  # marginal cost of one more collective (program overhead cancels)
      print(f"{settings or 'default'} {name:10s} {nbytes >> 20:5d} MiB: {t * 1e6:8.1f} us/op marginal "
            f"({t10 / 10 * 1e6:.1f} us/op in a chain of 10)  busbw {nbytes / t / 1e9:6.1f} GB/s  "
            f"sms_used {rt.stats()['sms_used']:.0f}", flush=True)
      dfccl.configure(trace=True)
      time.sleep(0.01)  # the idle daemon quits; its successor records
      jax.block_until_ready(f10(x))
      recs = [r for r in trace.records() if r[0] == "cuda"]
      dfccl.configure(trace=False)
      time.sleep(0.01)
      breakdown(recs)
  s = rt.stats()
  print({k: round(v, 2) for k, v in s.items() if k.startswith("host_")}, flush=True)


def crossover():
  ops = {"psum": lambda y: dfccl.psum(y, "x") * 0.5,
         "all_gather": lambda y: dfccl.all_gather(y, "x", tiled=True)[: y.shape[0]],
         "psum_scatter": lambda y: jnp.tile(dfccl.psum_scatter(y, "x", tiled=True), N)}
  # Long chains and many repetitions: a program launch varies by ~0.5 ms, which
  # chains of 12 and 2 turned into +-50 us per op.
  long, short = 42, 2
  saved = {k: dfccl.config.as_dict()[k] for k in ("copy_engine_min_bytes", "copy_engine_reduce_min_bytes")}
  print(f"marginal us/op (chain of {long} minus chain of {short}): daemon | copy engine", flush=True)
  for mib in (1, 2, 4, 8, 16, 64):
    x = jnp.ones((N, (mib << 20) // 2), jnp.bfloat16)
    for name, op in ops.items():
      f_short, f_long = chain(short, op), chain(long, op)
      row = []
      for path in (-1, 0):
        dfccl.configure(copy_engine_min_bytes=path, copy_engine_reduce_min_bytes=0)
        s0 = dfccl.stats()["cuda"]
        t_short = common.median_time(f_short, x, reps=11, warmup=1)
        t_long = common.median_time(f_long, x, reps=11, warmup=1)
        s1 = dfccl.stats()["cuda"]
        row.append((t_long - t_short) / (long - short) * 1e6)
      dn = lambda k: s1[k] - s0[k]
      ops_n, timed = max(dn("copy_engine_ops"), 1), max(dn("copy_engine_timed"), 1)
      print(f"{name:12s} {mib:3d} MiB: daemon {row[0]:8.1f}  copy engine {row[1]:8.1f} us/op "
            f"(per op: host issue {dn('copy_engine_issue_us') / ops_n:.1f} us, "
            f"rank-0 GPU {dn('copy_engine_gpu_us') / timed:.1f} us)", flush=True)
  dfccl.configure(**saved)


def large(sizes_mib=(64, 256, 1024)):
  dfccl.configure(copy_engine_min_bytes=4 << 20)
  ops = {"all_gather": lambda y: dfccl.all_gather(y, "x", tiled=True)[: y.shape[0]],
         "psum": lambda y: dfccl.psum(y, "x") * 0.5}
  n = 10
  for mib in sizes_mib:
    elems = (mib << 20) // 2
    x = jnp.asarray(np.arange(N * elems, dtype=np.float32).reshape(N, elems) % 251, jnp.bfloat16)
    g = jax.jit(jax.shard_map(lambda v: dfccl.all_gather(v[0], "x", tiled=True)[None], mesh=MESH,
                              in_specs=P("x"), out_specs=P("x"), check_vma=False))
    got = np.asarray(g(x), np.float32)
    want = np.asarray(x, np.float32).reshape(-1)
    print(f"all_gather {mib} MiB exact on every rank: {all(np.array_equal(got[r], want) for r in range(N))}",
          flush=True)
    del got
    for name, op in ops.items():
      for mode in ("unrolled", "fori_loop"):
        if mode == "unrolled":
          f = chain(n, op)
        else:
          f = jax.jit(jax.shard_map(lambda v, op=op: jax.lax.fori_loop(0, n, lambda i, y: op(y), v[0])[None],
                                    mesh=MESH, in_specs=P("x"), out_specs=P("x"), check_vma=False))
        jax.block_until_ready(f(x))
        s0 = dfccl.stats()["cuda"]
        t = common.median_time(f, x, reps=3, warmup=0) / n
        s1 = dfccl.stats()["cuda"]
        dn = lambda k: s1[k] - s0[k]  # noqa: E731
        gpu = dn("copy_engine_gpu_us") / max(dn("copy_engine_timed"), 1)
        print(f"{name:10s} {mib:5d} MiB {mode:9s}: wall {t * 1e6:9.1f} us/op  busbw {(mib << 20) / t / 1e9:6.1f} GB/s"
              f"  copy-engine ops {dn('copy_engine_ops'):.0f}, rank-0 GPU {gpu:9.1f} us/op, host issue "
              f"{dn('copy_engine_issue_us') / max(dn('copy_engine_ops'), 1):.1f} us/op", flush=True)


def main():
  if "--large" in sys.argv:  # --large [MiB,...]
    i = sys.argv.index("--large")
    sizes = sys.argv[i + 1] if len(sys.argv) > i + 1 else "64,256,1024"
    large(tuple(int(m) for m in sizes.split(",")))
    return
  if "--crossover" in sys.argv:
    crossover()
    return
  if "--bw" in sys.argv:  # --bw [name=value,...]: GPU runtime settings
    i = sys.argv.index("--bw")
    kv = sys.argv[i + 1] if len(sys.argv) > i + 1 else ""
    bandwidth({k: float(v) for k, v in (p.split("=") for p in kv.split(",") if p)})
    return
  nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
  x = jnp.ones((N, nbytes // 2), jnp.bfloat16)
  f = chain(NOPS)
  from jax_dfccl._src import backend
  rt = backend.load()["cuda"]
  print(f"psum {nbytes} B: {per_op_us(f, x):.1f} us/op (trace off)", flush=True)
  # Host dispatch rate: time to enqueue the program without waiting for it.
  jax.block_until_ready(f(x))
  t0 = time.perf_counter()
  out = f(x)
  t_call = time.perf_counter() - t0
  jax.block_until_ready(out)
  t_all = time.perf_counter() - t0
  print(f"call returns after {t_call * 1e6:.0f} us, result after {t_all * 1e6:.0f} us", flush=True)
  dfccl.configure(trace=True)
  time.sleep(0.01)  # the idle daemon quits; its successor records
  try:
    jax.block_until_ready(f(x))
    recs = [r for r in trace.records() if r[0] == "cuda"]
  finally:
    dfccl.configure(trace=False)
  breakdown(recs)
  s = backend.load()["cuda"].stats()
  print({k: round(v, 2) for k, v in s.items() if k.startswith("host_")}, flush=True)

if __name__ == "__main__":
  main()
