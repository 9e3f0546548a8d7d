"""Collective benchmark on GPUs: jax_dfccl vs jax.lax in the same run.

Per op and size (bf16, bytes per device): a chain of dependent collectives
unrolled in one jit, and the same inside lax.fori_loop; us/op and busbw as in
nccl-tests.  Then the chaos-order workload (rank-dependent start order) vs the
same collectives in consistent order with jax.lax, a gradient-sync step (psum of a
32-leaf pytree), and the chaos program with jax.lax collectives in a subprocess
under a timeout (it hangs).

  python benchmarks/collectives.py [--out DIR] [--quick] [--max-mib N]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import common  # noqa: E402

N = len(jax.devices())
MESH = Mesh(np.array(jax.devices()), ("x",))
KiB, MiB = 1024, 1024 * 1024


def smap(f, donate=False):
  return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=P("x"), out_specs=P("x"), check_vma=False),
                 donate_argnums=(0,) if donate else ())


def lax_ops():
  return {
      "psum": lambda y: jax.lax.psum(y, "x") * 0.5,
      "all_gather": lambda y: jax.lax.all_gather(y, "x", tiled=True)[: y.shape[0]],
      "psum_scatter": lambda y: jnp.tile(jax.lax.psum_scatter(y, "x", tiled=True), N),
      "all_to_all": lambda y: jax.lax.all_to_all(y, "x", 0, 0, tiled=True),
  }


def dfccl_ops():
  """Public jax_dfccl API; falls back to the raw custom calls if it is unusable."""
  try:
    import jax_dfccl as d
    ops = {
        "psum": lambda y: d.psum(y, "x") * 0.5,
        "all_gather": lambda y: d.all_gather(y, "x", tiled=True)[: y.shape[0]],
        "psum_scatter": lambda y: jnp.tile(d.psum_scatter(y, "x", tiled=True), N),
        "all_to_all": lambda y: d.all_to_all(y, "x", 0, 0, tiled=True),
    }
    x = jnp.arange(N * 64, dtype=jnp.float32).reshape(N, 64)
    got = smap(lambda v: ops["psum"](v[0])[None])(x)
    want = smap(lambda v: lax_ops()["psum"](v[0])[None])(x)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    return ops, "jax_dfccl public API"
  except Exception as e:  # noqa: BLE001
    print("public API unusable, using raw custom calls:", repr(e)[:300], flush=True)
    import ffi_direct as fd
    ops = {
        "psum": lambda y: fd.collective(y, "all_reduce", "x", N) * 0.5,
        "all_gather": lambda y: fd.collective(y, "all_gather", "x", N)[: y.shape[0]],
        "psum_scatter": lambda y: jnp.tile(fd.collective(y, "reduce_scatter", "x", N), N),
        "all_to_all": lambda y: fd.collective(y, "all_to_all", "x", N),
    }
    return ops, "raw custom calls (benchmarks/ffi_direct.py)"


def busbw(op, nbytes, t):
  if op == "psum":
    return nbytes / t * 2 * (N - 1) / N
  if op == "all_gather":
    return N * nbytes / t * (N - 1) / N
  return nbytes / t * (N - 1) / N


def chain(fn, n_ops, mode, donate=False):
  def body(v):
    y = v[0]
    if mode == "unrolled":
      for _ in range(n_ops):
        y = fn(y)
    else:
      y = jax.lax.fori_loop(0, n_ops, lambda i, y: fn(y), y)
    return y[None]
  return smap(body, donate)


_progress = {"t": time.perf_counter(), "what": "start"}


def stall_reporter(every_s):
  """Prints jax_dfccl.pending() whenever no benchmark step finished for `every_s` seconds."""
  import threading  # noqa: PLC0415

  import jax_dfccl as d  # noqa: PLC0415

  def run():
    while True:
      time.sleep(1.0)
      if time.perf_counter() - _progress["t"] > every_s:
        print(f"--- no progress for {every_s:.0f} s after {_progress['what']}; jax_dfccl.pending():\n"
              + d.pending(), flush=True)
        _progress["t"] = time.perf_counter()
  threading.Thread(target=run, daemon=True).start()


def bench_ops(sizes, ops_names, reps, pipelined=False):
  """pipelined: also time the unrolled chain with 8 calls enqueued before blocking, and donated."""
  ours, how = dfccl_ops()
  lax = lax_ops()
  rows = []
  for nbytes in sizes:
    elems = nbytes // 2
    x = jnp.asarray(np.random.default_rng(0).standard_normal((N, elems)), jnp.bfloat16)
    # Long chains, so that the fixed cost of launching a program (about 1 ms
    # with two GPUs, for both implementations) does not count as per-op time.
    n_ops = 100 if nbytes <= 16 * MiB else 20
    for op in ops_names:
      row = {"op": op, "bytes": nbytes, "n_ops": n_ops}
      for impl, fns in (("dfccl", ours), ("jax.lax", lax)):
        for mode in ("unrolled", "fori_loop"):
          try:
            t = common.median_time(chain(fns[op], n_ops, mode), x, reps=reps, warmup=1) / n_ops
            row[f"{impl}/{mode}/us"] = t * 1e6
            row[f"{impl}/{mode}/busbw_GBs"] = busbw(op, nbytes, t) / 1e9
          except Exception as e:  # noqa: BLE001
            row[f"{impl}/{mode}/error"] = repr(e)[:200]
          _progress.update(t=time.perf_counter(), what=f"{op} {nbytes} B {impl} {mode}")
        if pipelined:  # the unrolled chain with calls enqueued back to back (host work hidden)
          try:
            t = common.pipelined_time(chain(fns[op], n_ops, "unrolled"), x, reps=reps) / n_ops
            row[f"{impl}/pipelined/us"] = t * 1e6
            row[f"{impl}/pipelined/busbw_GBs"] = busbw(op, nbytes, t) / 1e9
          except Exception as e:  # noqa: BLE001
            row[f"{impl}/pipelined/error"] = repr(e)[:200]
          try:  # the same, each call donating its input and fed the last output (a training step's buffers)
            t = common.donated_time(chain(fns[op], n_ops, "unrolled", donate=True), x, reps=reps) / n_ops
            row[f"{impl}/donated/us"] = t * 1e6
          except Exception as e:  # noqa: BLE001
            row[f"{impl}/donated/error"] = repr(e)[:200]
      rows.append(row)
      u = lambda k: row.get(k, float("nan"))  # noqa: E731
      print(f"{op:13s} {nbytes:>11d} B  dfccl {u('dfccl/unrolled/us'):9.1f} / {u('dfccl/fori_loop/us'):9.1f} us"
            f"  lax {u('jax.lax/unrolled/us'):9.1f} / {u('jax.lax/fori_loop/us'):9.1f} us"
            f"  busbw dfccl {u('dfccl/unrolled/busbw_GBs'):6.1f} lax {u('jax.lax/unrolled/busbw_GBs'):6.1f} GB/s"
            f"  pipelined dfccl {u('dfccl/pipelined/us'):7.1f} lax {u('jax.lax/pipelined/us'):7.1f} us"
            f"  donated dfccl {u('dfccl/donated/us'):7.1f} lax {u('jax.lax/donated/us'):7.1f} us",
            flush=True)
  return rows, how




def bench_pytree(reps, n_leaves=32, steps=20):
  """A gradient-sync step: psum of a pytree of `n_leaves` float32 leaves (1 KiB ..
  512 KiB each), `steps` dependent steps in fori_loop; ms per step, ours vs jax.lax."""
  import jax_dfccl as d  # noqa: PLC0415
  sizes = [256 << (i % 10) for i in range(n_leaves)]  # elements: 1 KiB .. 512 KiB
  tree = {f"p{i}": jnp.ones((N, s), jnp.float32) * (i + 1) for i, s in enumerate(sizes)}

  def program(red):
    def body(t):
      t = {k: v[0] for k, v in t.items()}
      t = jax.lax.fori_loop(0, steps, lambda i, t: jax.tree.map(lambda v: v * 0.5, red(t, "x")), t)
      return {k: v[None] for k, v in t.items()}
    return smap(body)

  ours, ref = program(d.psum), program(jax.lax.psum)
  ok = all(bool(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5))
           for a, b in zip(jax.tree.leaves(ours(tree)), jax.tree.leaves(ref(tree))))
  t_ours = common.median_time(ours, tree, reps=max(reps, 3)) / steps
  t_lax = common.median_time(ref, tree, reps=max(reps, 3)) / steps
  res = {"leaves": n_leaves, "bytes": 4 * sum(sizes), "dfccl_ms_per_step": t_ours * 1e3,
         "lax_ms_per_step": t_lax * 1e3, "matches_lax": ok}
  print(f"pytree psum ({n_leaves} leaves, {4 * sum(sizes)} B): dfccl {t_ours*1e3:.3f} ms/step, "
        f"jax.lax {t_lax*1e3:.3f} ms/step, results match: {ok}", flush=True)
  return res


def chaos_program(kind, nbytes):
  """8 collectives (psum, all_gather alternating); 'dfccl': rank-specific start
  order then all dones; 'lax': jax.lax in one consistent order."""
  from jax_dfccl import testing as T  # noqa: PLC0415
  elems = nbytes // 2
  body = (T.alternating_reference("x", elems) if kind == "lax"
          else T.alternating_chaos("x", N, elems, seed=1))
  return smap(lambda v: body(v[0])[None])


HANG_SCRIPT = textwrap.dedent("""
  import os, jax, jax.numpy as jnp, numpy as np
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()), ("x",))
  def body(v):
    y = v[0]
    a = lambda y: jax.lax.psum(y, "x") + jax.lax.all_gather(y, "x", tiled=True)[: y.shape[0]]
    b = lambda y: jax.lax.all_gather(y, "x", tiled=True)[: y.shape[0]] + jax.lax.psum(y, "x")
    return jax.lax.switch(jax.lax.axis_index("x"), [a, b], y)[None]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  x = jnp.ones((len(jax.devices()), 1 << 18), jnp.float32)
  print("result", float(jax.block_until_ready(f(x)).sum()), flush=True)
""")


def lax_hang(timeout_s):
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.1")
  t0 = time.perf_counter()
  try:
    p = subprocess.run([sys.executable, "-c", HANG_SCRIPT], env=env, capture_output=True, text=True, timeout=timeout_s)
    return {"hung": False, "rc": p.returncode, "seconds": time.perf_counter() - t0, "stdout": p.stdout[-300:],
            "stderr": p.stderr[-300:]}
  except subprocess.TimeoutExpired:
    return {"hung": True, "timeout_s": timeout_s, "seconds": time.perf_counter() - t0}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=None)
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--max-mib", type=float, default=1024)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--sizes", default=None, help="comma-separated sizes per device, e.g. 16M,1G (default: 4K..1G)")
  ap.add_argument("--no-chaos", action="store_true", help="skip the chaos-order workloads and the jax.lax hang check")
  ap.add_argument("--hang-timeout", type=float, default=20)
  ap.add_argument("--config", default="", help="jax_dfccl.config entries for this run, e.g. "
                  "copy_engine_min_bytes=4194304,copy_engine_reduce_min_bytes=4194304")
  ap.add_argument("--tag", default="h200x2", help="suffix of the result files' names")
  ap.add_argument("--stall-report", type=float, default=60,
                  help="print jax_dfccl.pending() when a step takes longer than this (s); 0: never")
  ap.add_argument("--pipelined", action="store_true",
                  help="also time the unrolled chain with 8 calls enqueued back to back before blocking "
                  "(per-call host work hidden behind the device: the device-bound time per op), and the "
                  "same with each call donating its input and fed the last output (buffers that stay put)")
  a = ap.parse_args()
  if a.stall_report > 0:
    stall_reporter(a.stall_report)
  if a.config:
    import jax_dfccl as d  # noqa: PLC0415
    d.configure(**common.parse_config(a.config))
  sizes = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB, 1024 * MiB]
  sizes = [s for s in sizes if s <= a.max_mib * MiB]
  ops_names = ["psum", "all_gather", "psum_scatter", "all_to_all"]
  if a.quick:
    sizes = [s for s in sizes if s in (4 * KiB, 64 * KiB, 16 * MiB, 1024 * MiB)]
  if a.sizes:
    sizes = common.parse_sizes(a.sizes)
  rows, how = bench_ops(sizes, ops_names, a.reps, a.pipelined)
  chaos = {}
  try:
    import jax_dfccl as d
    for nbytes in (() if a.no_chaos else (64 * KiB, 4 * MiB)):
      x = jnp.asarray(np.random.default_rng(2).standard_normal((N, nbytes // 2)), jnp.bfloat16)
      ours, ref = chaos_program("dfccl", nbytes), chaos_program("lax", nbytes)
      ok = bool(np.allclose(np.asarray(ours(x), np.float32), np.asarray(ref(x), np.float32), rtol=2e-2, atol=2e-2))
      t_ours = common.median_time(ours, x, reps=10)
      t_lax = common.median_time(ref, x, reps=10)
      chaos[str(nbytes)] = {"dfccl_chaos_ms": t_ours * 1e3, "lax_consistent_ms": t_lax * 1e3,
                            "ratio": t_ours / t_lax, "matches_lax": ok}
      print(f"chaos {nbytes} B x 8: dfccl (rank-specific order) {t_ours*1e3:.3f} ms, "
            f"jax.lax (consistent order) {t_lax*1e3:.3f} ms, ratio {t_ours/t_lax:.2f}, results match: {ok}", flush=True)
    chaos["stats"] = {k: v for k, v in d.stats().get("cuda", {}).items() if k != "errors"}
  except Exception as e:  # noqa: BLE001
    chaos["error"] = repr(e)[:400]
    print("chaos benchmark failed:", repr(e)[:400], flush=True)
  try:
    pytree = bench_pytree(a.reps)
  except Exception as e:  # noqa: BLE001
    pytree = {"error": repr(e)[:400]}
    print("pytree benchmark failed:", repr(e)[:400], flush=True)
  hang = "not run (--no-chaos)" if a.no_chaos else lax_hang(a.hang_timeout)
  print("jax.lax chaos program in a subprocess:", hang, flush=True)
  payload = {"header": common.header(), "config": a.config, "implementation": how, "n_devices": N, "dtype": "bfloat16",
             "rows": rows, "chaos": chaos, "pytree_psum": pytree, "lax_chaos_subprocess": hang}
  md = ["| op | bytes/device | ops | dfccl unrolled us | dfccl fori us | lax unrolled us | lax fori us |"
        " dfccl busbw GB/s | lax busbw GB/s | dfccl pipelined us | lax pipelined us | dfccl donated us | lax donated us |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    g = lambda k: f"{r[k]:.1f}" if k in r else "err" if k.rsplit("/", 1)[0] + "/error" in r else "-"  # noqa: E731
    md.append(f"| {r['op']} | {r['bytes']} | {r['n_ops']} | {g('dfccl/unrolled/us')} | {g('dfccl/fori_loop/us')} | "
              f"{g('jax.lax/unrolled/us')} | {g('jax.lax/fori_loop/us')} | {g('dfccl/unrolled/busbw_GBs')} | "
              f"{g('jax.lax/unrolled/busbw_GBs')} | {g('dfccl/pipelined/us')} | {g('jax.lax/pipelined/us')} | "
              f"{g('dfccl/donated/us')} | {g('jax.lax/donated/us')} |")
  md.append("")
  for k, v in chaos.items():
    md.append(f"- chaos {k}: {v}")
  md.append(f"- pytree psum (gradient-sync step): {pytree}")
  md.append(f"- jax.lax chaos program (subprocess): {hang}")
  name = "collectives_" + time.strftime("%Y-%m-%d") + "_" + a.tag
  common.write_results(name, payload, "\n".join(md), a.out)
  print("\n".join(md), flush=True)


if __name__ == "__main__":
  main()
