"""GEMM + communication overlap benchmark, tensor parallelism over 2 devices.

For each shape (global M x N x K, Megatron shards) it times, per op inside one
jitted program (``ITERS`` ops unrolled, each made to wait for the previous
with an optimization barrier, every result an output so that XLA keeps every
op; median over repetitions):

  t_gemm        the per-rank GEMM alone
  t_comm        the jax.lax collective alone (all_gather / psum_scatter)
  sequential    GEMM and jax.lax collective in shard_map, one after the other
  xla_plain     plain jax.jit of ``x @ w`` on sharded arrays (XLA's SPMD partitioner)
  xla_windowed  the same under --xla_gpu_threshold_for_windowed_einsum_mib=0
                --xla_gpu_multi_streamed_windowed_einsum=true (own process)
  ours_lax      jax_dfccl all_gather_matmul / matmul_reduce_scatter on jax.lax collectives
  ours_dfccl    the same on jax_dfccl's start/done collectives (when the runtime is built)
  ours_fused    the fused sm90 GEMM with tile-wise signaling (_dfccl_overlap, bf16 on GPU);
                ours_lax / ours_dfccl are traced with it turned off
  fused_legacy  ours_fused with overlap_copy_engine=False, overlap_cta_fence=False (the
                first version: SM push kernel for AG rows, per-thread fences in RS)
  fused_rsce    RS only: ours_fused with overlap_rs_copy_engine_min_bytes=0 (partials moved by
                the copy engine)
  bound         max(t_gemm, bytes moved per rank / 392 GB/s)

  python benchmarks/overlap.py --tag h200x2            # GPU, full grid
  python benchmarks/overlap.py --scale 64 --tag cpu    # CPU smoke run (2 forced devices)
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys

WINDOWED_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0 "
                  "--xla_gpu_multi_streamed_windowed_einsum=true")
COPY_ENGINE_BPS = 392e9
AG_NK = [(14336, 4096), (28672, 8192), (49152, 12288)]
RS_NK = [(4096, 14336), (8192, 28672), (12288, 49152)]
MS = [1024, 4096, 8192]
VARIANTS = ["t_gemm", "t_comm", "sequential", "xla_plain", "xla_windowed", "ours_lax",
            "ours_dfccl", "ours_fused", "fused_legacy", "fused_rsce", "bound"]


def shapes(args):
  out = []
  for nk_i in range(3):  # LLaMA-3-8B shapes first: they carry the 1.15x target
    for m in args.m:
      out.append(("ag", m, *AG_NK[nk_i]))
      out.append(("rs", m, *RS_NK[nk_i]))
  return [(k, m // args.scale, n // args.scale, kk // args.scale) for k, m, n, kk in out
          if k in args.ops][: args.limit or None]


def _setup_jax(args):
  if args.cpu:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=2")
    os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(kind, M, N, K, names, it):
  """Returns {variant: (jitted fn, args)} for one shape."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  from jax_dfccl._src import overlap as ov
  from jax_dfccl._src import overlap_gpu as ovg

  mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
  bf = jnp.bfloat16
  if kind == "ag":
    xs, ws, os_ = P("tp", None), P(None, "tp"), P(None, "tp")
  else:
    xs, ws, os_ = P(None, "tp"), P("tp", None), P("tp", None)
  kx, kw = jax.random.split(jax.random.key(0))
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
  x = put(jax.random.normal(kx, (M, K), bf), xs)
  w = put((jax.random.normal(kw, (K, N), jnp.float32) / K ** 0.5).astype(bf), ws)

  def chain(body, iters):
    # Every op's result is an output: XLA removes ops whose result is unused
    # (an optimization barrier does not keep them), which made every variant
    # but the side-effecting fused kernel look up to ITERS times faster.
    def f(x, w):
      ys = []
      for _ in range(iters):
        y = body(x, w)
        x, y = lax.optimization_barrier((x, y))  # op i+1 starts after op i ends
        ys.append(y)
      return tuple(ys)
    return f

  def per_shard_loop(body, in_specs, out_specs, iters):
    return jax.jit(jax.shard_map(chain(body, iters), mesh=mesh, in_specs=in_specs,
                                 out_specs=(out_specs,) * iters))

  out = {}

  def add(name, make):
    if name in names:
      out[name] = make

  if kind == "ag":
    add("t_gemm", lambda: (per_shard_loop(lambda x, w: x @ w, (P(), ws), os_, it),
                           (put(x, P()), w)))
    add("t_comm", lambda: (per_shard_loop(
        lambda x, w: lax.all_gather(x, "tp", tiled=True), (xs, ws), P("tp"), it), (x, w)))
    add("sequential", lambda: (per_shard_loop(
        lambda x, w: lax.all_gather(x, "tp", tiled=True) @ w, (xs, ws), os_, it), (x, w)))
    op = ov.all_gather_matmul
  else:
    add("t_gemm", lambda: (per_shard_loop(lambda x, w: x @ w, (xs, ws), P("tp"), it), (x, w)))
    add("t_comm", lambda: (per_shard_loop(
        lambda y, w: lax.psum_scatter(y, "tp", tiled=True), (P("tp"), ws), os_, it),
        (put(jnp.zeros((2 * M, N), bf), P("tp")), w)))
    add("sequential", lambda: (per_shard_loop(
        lambda x, w: lax.psum_scatter(x @ w, "tp", tiled=True), (xs, ws), os_, it), (x, w)))
    op = ov.matmul_reduce_scatter
  plain = chain(lambda x, w: lax.with_sharding_constraint(x @ w, NamedSharding(mesh, os_)), it)
  add("xla_plain", lambda: (jax.jit(plain), (x, w)))
  add("xla_windowed", lambda: (jax.jit(plain), (x, w)))
  for backend in ("lax", "dfccl"):
    def make(backend=backend):
      with ov.collectives(backend), ovg.fused(False):
        f = per_shard_loop(lambda x, w: op(x, w, "tp"), (xs, ws), os_, it)
        f.lower(x, w)  # trace now, under this backend
        return f, (x, w)
    add("ours_" + backend, make)

  def make_fused(**cfg):  # config entries are read at trace time
    if not ovg.available():
      raise RuntimeError("fused overlap module not available (needs GPU and _dfccl_overlap)")
    from jax_dfccl.config import config  # noqa: PLC0415
    old = {k: getattr(config, k) for k in cfg}
    try:
      for k, v in cfg.items():
        setattr(config, k, v)
      with ovg.fused(True):
        f = per_shard_loop(lambda x, w: op(x, w, "tp"), (xs, ws), os_, it)
        if "dfccl_overlap_" not in f.lower(x, w).as_text():
          raise RuntimeError("fused kernel not applicable to this shape")
    finally:
      for k, v in old.items():
        setattr(config, k, v)
    return f, (x, w)
  add("ours_fused", make_fused)
  add("fused_legacy", lambda: make_fused(overlap_copy_engine=False, overlap_cta_fence=False,
                                         overlap_rs_copy_engine_min_bytes=-1))
  if kind == "rs":
    add("fused_rsce", lambda: make_fused(overlap_rs_copy_engine_min_bytes=0))
  return out


def measure(kind, M, N, K, names, iters, reps):
  import jax

  from common import median_time  # noqa: PLC0415
  res = {}
  try:
    makers = build(kind, M, N, K, names, iters)
  except Exception as e:  # noqa: BLE001
    return {"build_error": f"{type(e).__name__}: {str(e)[:500]}"}
  for name, make in makers.items():
    try:
      f, a = make()
      res[name] = median_time(f, *a, reps=reps, warmup=1) / iters * 1e3
    except Exception as e:  # noqa: BLE001  record and go on: one variant must not sink the run
      res[name] = None
      res[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    jax.clear_caches()
  return res


def _worker(args):
  """Child process: XLA_FLAGS already hold the windowed-einsum flags."""
  _setup_jax(args)
  rows = {}
  for s in shapes(args):
    rows[json.dumps(s)] = measure(*s, ["xla_windowed"], args.iters, args.reps)
    with open(args.worker_out, "w") as f:
      json.dump(rows, f)


def _row_md(s, r):
  kind, M, N, K = s
  f = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
  ours = min([v for v in (r.get("ours_lax"), r.get("ours_dfccl"), r.get("ours_fused")) if v]
             or [None])
  xla = min([v for v in (r.get("xla_plain"), r.get("xla_windowed")) if v] or [None])
  mx = max(r.get("t_gemm") or 0, r.get("t_comm") or 0)
  ratio = f"{ours / mx:.2f}" if ours and mx else "—"
  speed = f"{xla / ours:.2f}" if ours and xla else "—"
  return [f"{kind.upper()} {M}×{N}×{K}", *(f(r.get(v)) for v in VARIANTS), ratio, speed]


def report(args, results, header):
  from common import md_table, write_results  # noqa: PLC0415
  rows = [_row_md(json.loads(k), r) for k, r in results.items()]
  md = ("Per-op ms, TP=2, bfloat16 (global M×N×K; ours/max = ours / max(t_gemm, t_comm), "
        "target ≤ 1.05; XLA/ours = better XLA variant / ours, target ≥ 1.15 on LLaMA "
        "shapes at M ≤ 4096).\n\n" +
        md_table(["shape", *VARIANTS, "ours/max", "XLA/ours"], rows))
  errs = {k: {e: v for e, v in r.items() if e.endswith("_error")} for k, r in results.items()}
  errs = {k: v for k, v in errs.items() if v}
  if errs:
    md += "\n\nErrors:\n" + "\n".join(f"- {k}: {v}" for k, v in errs.items())
  payload = {"header": header, "iters": args.iters, "reps": args.reps,
             "rows": [{"kind": json.loads(k)[0], "M": json.loads(k)[1], "N": json.loads(k)[2],
                       "K": json.loads(k)[3], **r} for k, r in results.items()]}
  name = f"overlap_{dt.date.today().isoformat()}_{args.tag}"
  return write_results(name, payload, md, args.outdir)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--ops", default="ag,rs", type=lambda s: s.split(","))
  p.add_argument("--m", default=MS, type=lambda s: [int(v) for v in s.split(",")])
  p.add_argument("--scale", type=int, default=1, help="divide every dimension (CPU smoke runs)")
  p.add_argument("--limit", type=int, default=0, help="only the first LIMIT shapes")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--cpu", action="store_true", help="2 forced CPU devices")
  p.add_argument("--no-windowed", action="store_true")
  p.add_argument("--variants", default=None, type=lambda s: s.split(","),
                 help="only these variants (comma-separated; default all)")
  p.add_argument("--windowed-iters", type=int, default=1,
                 help="ops per program for xla_windowed: with the windowed-einsum flags XLA "
                      "(jax 0.11.2, H200) segfaulted compiling the 3-op barrier chain, so by "
                      "default each program holds one op (its time includes the launch)")
  p.add_argument("--tag", default="local")
  p.add_argument("--outdir", default=None, help="default benchmarks/results")
  p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker_out:
    return _worker(args)
  windowed = {}
  if not args.no_windowed:
    # Own process (XLA_FLAGS is read once at start-up), run before this one
    # touches the GPUs (XLA preallocates most of their memory).
    wfile = os.path.join(args.outdir or "/tmp", f"overlap_windowed_{os.getpid()}.json")
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + WINDOWED_FLAGS))
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--worker-out", wfile,
           "--iters", str(args.windowed_iters)]
    child = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000)
    if os.path.exists(wfile):
      windowed = json.load(open(wfile))
      os.remove(wfile)
    if child.returncode or not windowed:
      print("windowed-einsum process failed:\n", child.stdout[-2000:], child.stderr[-3000:])
  _setup_jax(args)
  from common import header  # noqa: PLC0415
  hdr = header()
  hdr["xla_windowed_flags"] = WINDOWED_FLAGS
  hdr["xla_windowed_iters"] = args.windowed_iters
  results = {}
  names = [v for v in VARIANTS if v not in ("xla_windowed", "bound")
           and (args.variants is None or v in args.variants)]
  for s in shapes(args):
    r = measure(*s, names, args.iters, args.reps)
    kind, M, N, K = s
    moved = (M // 2) * (K if kind == "ag" else N) * 2
    r["bytes_moved_per_rank"] = moved
    r["bound"] = max(r.get("t_gemm") or 0, moved / COPY_ENGINE_BPS * 1e3)
    r.update(windowed.get(json.dumps(s), {}))
    results[json.dumps(s)] = r
    print(json.dumps({"shape": s, **r}), flush=True)
    report(args, results, hdr)
  for path in report(args, results, hdr):
    print("wrote", path)


if __name__ == "__main__":
  main()
