"""GEMM + communication overlap benchmark, tensor parallelism over 2 devices.

Shapes (global M x N x K, Megatron shards, TP=2): AG+GEMM at M in {1024, 4096,
8192} with (N, K) in {(14336, 4096), (28672, 8192), (49152, 12288)}; GEMM+RS at
the same M with (N, K) in {(4096, 14336), (8192, 28672), (12288, 49152)}; the
LLaMA-3-8B pairs first (they carry the 1.15x target).  Per shape, ms per op:

  t_gemm        the per-rank GEMM alone
  t_comm        the jax.lax collective alone (all_gather / psum_scatter)
  sequential    GEMM and jax.lax collective in shard_map, one after the other
  xla_plain     plain jax.jit of ``x @ w`` on sharded arrays (XLA's SPMD partitioner)
  xla_windowed  the same under --xla_gpu_threshold_for_windowed_einsum_mib=0
                --xla_gpu_multi_streamed_windowed_einsum=true (XLA flags are
                process-wide: measured first, in a child process)
  ours_fused    the fused sm90 GEMM with tile-wise signaling (in _dfccl_cuda, bf16 on GPU)
  bound         max(t_gemm, bytes moved per rank / 392 GB/s copy-engine rate)
and, when asked for with --variants:
  ours_lax / ours_dfccl  jax_dfccl's ops on jax.lax / jax_dfccl start-done collectives
                (the chunked ring schedule, fused kernels off)
  fused_legacy  ours_fused with overlap_copy_engine=False, overlap_cta_fence=False,
                overlap_rs_copy_engine_min_bytes=-1 (SM push kernel, per-thread fences)
  fused_rsce    RS: ours_fused with overlap_rs_copy_engine_min_bytes=0 (copy engine)
  fused_mailbox ours_fused with readiness and addresses through the host mailbox only

Timing: a program holds a chain of ITERS dependent ops (each op's result is an
output, each op starts after the previous one: optimization barrier); the
program is called CALLS times back to back (asynchronous dispatch, so the
per-program host cost overlaps the device work) and the median over REPS of
wall time / (CALLS x ITERS) is the time per op.  ITERS and CALLS follow the
op's size.  --budget-s bounds the whole run (compilation included): the
windowed child gets --windowed-share of it; variants and shapes that would not
fit are recorded as skipped.

  python benchmarks/overlap.py --tag h200x2 --budget-s 330     # GPU, all shapes
  python benchmarks/overlap.py --cpu --scale 128 --tag cpu       # CPU smoke run
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import time

WINDOWED_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0 "
                  "--xla_gpu_multi_streamed_windowed_einsum=true")
COPY_ENGINE_BPS = 392e9
EST_FLOPS = 600e12  # per GPU, only to size the chains
AG_NK = [(14336, 4096), (28672, 8192), (49152, 12288)]
RS_NK = [(4096, 14336), (8192, 28672), (12288, 49152)]
MS = [1024, 4096, 8192]
BASE = ["ours_fused", "t_gemm", "xla_plain", "t_comm", "sequential"]  # measurement order
EXTRA = ["ours_lax", "ours_dfccl", "fused_legacy", "fused_rsce", "fused_mailbox"]
COLUMNS = ["t_gemm", "t_comm", "sequential", "xla_plain", "xla_windowed", "ours_fused", *EXTRA, "bound"]


def shapes(args):
  out = []
  for i in range(3):
    for m in args.m:
      for kind in ("ag", "rs"):
        if kind in args.ops and i in args.nk:
          n, k = (AG_NK if kind == "ag" else RS_NK)[i]
          out.append((kind, m // args.scale, n // args.scale, k // args.scale))
  return out[: args.limit or None]


def plan(kind, M, N, K):
  """(ops per program, estimated ms per op) from the per-rank GEMM size."""
  est = M * N * K / EST_FLOPS * 1e3  # 2*M*N*K/2 flops per rank
  return max(2, min(8, round(1.0 / max(est, 1e-3)))), est


def _setup_jax(args):
  if args.cpu:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=2")
    os.environ["JAX_PLATFORMS"] = "cpu"
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path.insert(0, os.path.join(here, ".."))
  sys.path.insert(0, here)


def chain(body, iters):
  """f(x, w) -> the results of `iters` dependent calls of body(x, w), every one an output.

  XLA removes ops whose result is unused (an optimization barrier does not keep
  them); the barrier makes op i+1 start after op i ends."""
  from jax import lax

  def f(x, w):
    ys = []
    for _ in range(iters):
      y = body(x, w)
      x, y = lax.optimization_barrier((x, y))
      ys.append(y)
    return tuple(ys)
  return f


def build(kind, M, N, K, names, it):
  """Returns {variant: maker() -> (jitted fn, args)} for one shape."""
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

  def per_shard(body, in_specs, out_specs):
    return jax.jit(jax.shard_map(chain(body, it), mesh=mesh, in_specs=in_specs,
                                 out_specs=(out_specs,) * it))

  out = {}

  def add(name, make):
    if name in names:
      out[name] = make

  if kind == "ag":
    add("t_gemm", lambda: (per_shard(lambda x, w: x @ w, (P(), ws), os_), (put(x, P()), w)))
    add("t_comm", lambda: (per_shard(lambda x, w: lax.all_gather(x, "tp", tiled=True), (xs, ws),
                                     P("tp")), (x, w)))
    add("sequential", lambda: (per_shard(lambda x, w: lax.all_gather(x, "tp", tiled=True) @ w,
                                         (xs, ws), os_), (x, w)))
    op = ov.all_gather_matmul
  else:
    add("t_gemm", lambda: (per_shard(lambda x, w: x @ w, (xs, ws), P("tp")), (x, w)))
    add("t_comm", lambda: (per_shard(lambda y, w: lax.psum_scatter(y, "tp", tiled=True),
                                     (P("tp"), ws), os_),
                           (put(jnp.zeros((2 * M, N), bf), P("tp")), w)))
    add("sequential", lambda: (per_shard(lambda x, w: lax.psum_scatter(x @ w, "tp", tiled=True),
                                         (xs, ws), os_), (x, w)))
    op = ov.matmul_reduce_scatter
  plain = chain(lambda x, w: lax.with_sharding_constraint(x @ w, NamedSharding(mesh, os_)), it)
  add("xla_plain", lambda: (jax.jit(plain), (x, w)))
  add("xla_windowed", lambda: (jax.jit(plain), (x, w)))
  for backend in ("lax", "dfccl"):
    def make(backend=backend):
      with ov.collectives(backend), ovg.fused(False):
        f = per_shard(lambda x, w: op(x, w, "tp"), (xs, ws), os_)
        f.lower(x, w)  # trace now, under this backend
        return f, (x, w)
    add("ours_" + backend, make)

  def make_fused(bits=0, **cfg):  # config entries and diag bits are read at trace time
    if not ovg.available():
      raise RuntimeError("fused overlap ops not available (need sm90 GPUs and _dfccl_cuda built with CUTLASS)")
    import jax_dfccl  # noqa: PLC0415
    with jax_dfccl.configured(**cfg), ovg.fused(True), ovg.diag_mode(bits):
      f = per_shard(lambda x, w: op(x, w, "tp"), (xs, ws), os_)
      if "dfccl_overlap_" not in f.lower(x, w).as_text():
        raise RuntimeError("fused kernel not applicable to this shape")
    return f, (x, w)
  add("ours_fused", make_fused)
  add("fused_legacy", lambda: make_fused(overlap_copy_engine=False, overlap_cta_fence=False,
                                         overlap_rs_copy_engine_min_bytes=-1))
  if kind == "rs":
    add("fused_rsce", lambda: make_fused(overlap_rs_copy_engine_min_bytes=0))
  add("fused_mailbox", lambda: make_fused(bits=ovg.MODE_MAILBOX_ONLY))
  return out


def time_per_op(fn, args, iters, reps, min_rep_s):
  """ms per op: median over reps of (CALLS back-to-back calls) / (CALLS x iters)."""
  import jax
  jax.block_until_ready(fn(*args))  # compile + first run
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = time.perf_counter() - t
  calls = max(1, min(64, math.ceil(min_rep_s / max(one, 1e-6))))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)  # a device runs its programs in order: the last one ends last
    ts.append((time.perf_counter() - t) / (calls * iters))
  return statistics.median(ts) * 1e3, calls


def measure(shape, names, args, deadline, windowed=False):
  """{variant: ms, variant_error: ..., timing: {...}} for one shape, within deadline."""
  import jax
  kind, M, N, K = shape
  iters, est = plan(kind, M, N, K)
  if windowed:
    iters = args.windowed_iters
  res = {"timing": {"iters": iters}}
  try:
    makers = build(kind, M, N, K, names, iters)
  except Exception as e:  # noqa: BLE001
    return {"build_error": f"{type(e).__name__}: {str(e)[:500]}"}
  for name in names:
    if name not in makers:
      continue
    # A variant needs its compilation (a few s) and (warm-up + reps) x ~min_rep_s.
    need = 3.0 + (2 + args.reps) * max(args.min_rep_ms / 1e3, 2 * iters * est / 1e3)
    if time.time() + need > deadline:
      res[name] = None
      res[name + "_error"] = "skipped: time budget"
      continue
    try:
      f, a = makers[name]()
      res[name], res["timing"][name + "_calls"] = time_per_op(f, a, iters, args.reps,
                                                               args.min_rep_ms / 1e3)
    except Exception as e:  # noqa: BLE001  record and go on: one variant must not sink the run
      res[name] = None
      res[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  jax.clear_caches()
  return res


# ---------------------------------------------------------------------------
# The windowed-einsum child: XLA_FLAGS hold the flags; it writes its progress
# ({"rows": {shape: result}, "current": shape}) after every shape, so that a
# crash of XLA loses one shape only (the parent retries it with one op per
# program, then goes on without it).


def _worker(args):
  _setup_jax(args)
  todo = [tuple(s) for s in json.loads(args.worker_shapes)]
  state = {"rows": {}, "current": None}

  def dump():
    with open(args.worker_out + ".tmp", "w") as f:
      json.dump(state, f)
    os.replace(args.worker_out + ".tmp", args.worker_out)

  for s in todo:
    state["current"] = list(s)
    dump()
    state["rows"][json.dumps(list(s))] = measure(s, ["xla_windowed"], args, args.worker_deadline,
                                                 windowed=True)
    state["current"] = None
    dump()


def run_windowed(args, todo, deadline):
  """{json shape: result} from child processes; a shape whose child died is retried
  alone with one op per program, then given up."""
  rows, retried = {}, set()
  wfile = os.path.join(args.outdir or "/tmp", f"overlap_windowed_{os.getpid()}.json")
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + WINDOWED_FLAGS))
  jobs = [(list(todo), args.windowed_iters)]  # (shapes, ops per program)
  while jobs and time.time() < deadline - 5:
    shapes_, iters = jobs.pop(0)
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--worker-out", wfile,
           "--worker-shapes", json.dumps([list(s) for s in shapes_]),
           "--worker-deadline", str(deadline), "--windowed-iters", str(iters)]
    try:
      child = subprocess.run(cmd, env=env, capture_output=True, text=True,
                             timeout=max(10.0, deadline - time.time() + 10))
      rc, tail = child.returncode, child.stdout[-1000:] + child.stderr[-2000:]
    except subprocess.TimeoutExpired:
      rc, tail = "timeout", ""
    state = {"rows": {}, "current": None}
    if os.path.exists(wfile):
      state = json.load(open(wfile))
      os.remove(wfile)
    rows.update(state["rows"])
    done = {tuple(json.loads(k)) for k in state["rows"]}
    rest = [s for s in shapes_ if s not in done]
    cur = tuple(state["current"]) if state.get("current") else None
    if rc == 0 or not rest:
      continue
    if cur is None or cur not in rest:  # died outside a shape: report, give up on the rest
      print(f"windowed-einsum child failed (rc={rc}):\n{tail}", flush=True)
      for s in rest:
        rows[json.dumps(list(s))] = {"xla_windowed": None, "xla_windowed_error": f"child failed (rc={rc})"}
      continue
    rest.remove(cur)
    if iters > 1 and cur not in retried:
      retried.add(cur)
      jobs.insert(0, ([cur], 1))
    else:
      rows[json.dumps(list(cur))] = {"xla_windowed": None,
                                     "xla_windowed_error": f"child died (rc={rc}): {tail[-300:]}"}
    if rest:
      jobs.insert(1 if jobs and jobs[0][0] == [cur] else 0, (rest, args.windowed_iters))
  for job, _ in jobs:
    for s in job:
      rows.setdefault(json.dumps(list(s)), {"xla_windowed": None,
                                            "xla_windowed_error": "skipped: time budget"})
  return rows


# ---------------------------------------------------------------------------
# Report


def _row(s, r):
  kind, M, N, K = s
  moved = (M // 2) * (K if kind == "ag" else N) * 2
  r["bytes_moved_per_rank"] = moved
  r["bound"] = max(r.get("t_gemm") or 0, moved / COPY_ENGINE_BPS * 1e3) or None
  ours = r.get("ours_fused") or r.get("ours_dfccl") or r.get("ours_lax")
  xla = min([v for v in (r.get("xla_plain"), r.get("xla_windowed")) if v] or [0]) or None
  mx = max(r.get("t_gemm") or 0, r.get("t_comm") or 0) or None
  r["ours"] = ours
  r["ours_over_max"] = ours / mx if ours and mx else None
  r["ours_over_bound"] = ours / r["bound"] if ours and r["bound"] else None
  r["xla_over_ours"] = xla / ours if ours and xla else None
  return r


def _md(s, r, llama):
  f = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
  g = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
  kind, M, N, K = s
  ok_max = r["ours_over_max"] is not None and r["ours_over_max"] <= 1.05
  ok_xla = r["xla_over_ours"] is not None and r["xla_over_ours"] >= (1.15 if llama and M <= 4096 else 1.0)
  marks = ("✓" if ok_max else "✗") + ("✓" if ok_xla else "✗") if r["ours"] else "—"
  return [f"{kind.upper()} {M}×{N}×{K}", *(f(r.get(v)) for v in COLUMNS),
          g(r["ours_over_max"]), g(r["ours_over_bound"]), g(r["xla_over_ours"]), marks]


def report(args, results, header):
  from common import md_table, write_results  # noqa: PLC0415
  cols = [c for c in COLUMNS if c in ("t_gemm", "bound") or
          any(r.get(c) is not None or r.get(c + "_error") for r in results.values())]
  rows = []
  for k, r in results.items():
    s = tuple(json.loads(k))
    llama = (s[2], s[3]) in ((14336 // args.scale, 4096 // args.scale),
                             (4096 // args.scale, 14336 // args.scale))
    full = _md(s, r, llama)
    rows.append([full[0]] + [full[1 + COLUMNS.index(c)] for c in cols] + full[1 + len(COLUMNS):])
  md = ("ms per op, TP=2, bfloat16, global M×N×K.  ours = ours_fused (else the ring schedule); "
        "ours/max = ours / max(t_gemm, t_comm) (target ≤ 1.05); ours/bound = ours / bound; "
        "XLA/ours = better of xla_plain and xla_windowed / ours (target ≥ 1.15 on the LLaMA shapes "
        "at M ≤ 4096, ≥ 1 elsewhere); targets: ✓/✗ for the first and the second.\n\n" +
        md_table(["shape", *cols, "ours/max", "ours/bound", "XLA/ours", "targets"], rows))
  errs = {}  # message -> [(shape, variant)]
  for k, r in results.items():
    for e, v in r.items():
      if e.endswith("_error"):
        errs.setdefault(v, []).append(f"{' '.join(map(str, json.loads(k)))} {e[:-6]}")
  if errs:
    md += "\n\nNot measured:\n" + "\n".join(f"- {msg}: {', '.join(w)}" for msg, w in errs.items())
  payload = {"header": header, "reps": args.reps, "min_rep_ms": args.min_rep_ms,
             "rows": [{"kind": json.loads(k)[0], "M": json.loads(k)[1], "N": json.loads(k)[2],
                       "K": json.loads(k)[3], **r} for k, r in results.items()]}
  name = f"overlap_{dt.date.today().isoformat()}_{args.tag}"
  return write_results(name, payload, md, args.outdir)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--ops", default="ag,rs", type=lambda s: s.split(","))
  p.add_argument("--m", default=MS, type=lambda s: [int(v) for v in s.split(",")])
  p.add_argument("--nk", default=[0, 1, 2], type=lambda s: [int(v) for v in s.split(",")],
                 help="which (N, K) pairs: 0 LLaMA-3-8B, 1 and 2 the larger ones (default all)")
  p.add_argument("--scale", type=int, default=1, help="divide every dimension (CPU smoke runs)")
  p.add_argument("--limit", type=int, default=0, help="only the first LIMIT shapes")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--min-rep-ms", type=float, default=20.0,
                 help="back-to-back calls per repetition until about this long")
  p.add_argument("--budget-s", type=float, default=330.0, help="whole run, compilation included")
  p.add_argument("--windowed-share", type=float, default=0.3,
                 help="part of the budget for the windowed-einsum child")
  p.add_argument("--cpu", action="store_true", help="2 forced CPU devices")
  p.add_argument("--no-windowed", action="store_true")
  p.add_argument("--variants", default=None, type=lambda s: s.split(","),
                 help=f"measure these (default: {','.join(BASE)} and xla_windowed; more: "
                      f"{','.join(EXTRA)})")
  p.add_argument("--windowed-iters", type=int, default=3,
                 help="ops per xla_windowed program (a crashed compile is retried with 1)")
  p.add_argument("--tag", default="local")
  p.add_argument("--outdir", default=None, help="default benchmarks/results")
  p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
  p.add_argument("--worker-shapes", default=None, help=argparse.SUPPRESS)
  p.add_argument("--worker-deadline", type=float, default=0, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker_out:
    return _worker(args)
  t_start = time.time()
  deadline = t_start + args.budget_s
  todo = shapes(args)
  names = [v for v in BASE + EXTRA if (v in BASE if args.variants is None else v in args.variants)]
  want_windowed = not args.no_windowed and (args.variants is None or "xla_windowed" in args.variants)
  windowed = {}
  if want_windowed:
    # Before this process touches the GPUs (XLA preallocates most of their memory).
    windowed = run_windowed(args, list(todo), t_start + args.budget_s * args.windowed_share)
  _setup_jax(args)
  from common import header  # noqa: PLC0415
  hdr = header()
  hdr.update({"xla_windowed_flags": WINDOWED_FLAGS, "budget_s": args.budget_s,
              "timing": "chain of ITERS ops per program, CALLS programs back to back, median of "
                        "REPS of wall / (CALLS x ITERS); per shape under 'timing'"})
  if args.cpu:
    hdr["note"] = f"CPU smoke run, every dimension divided by {args.scale}"
  results = {}
  for i, s in enumerate(todo):
    # Each remaining shape gets an equal share of what is left (at least its own need).
    share = (deadline - time.time()) / (len(todo) - i)
    r = measure(s, names, args, min(deadline, time.time() + max(share, 0) * 1.5))
    w = windowed.get(json.dumps(list(s)))
    if w is not None:
      for k in ("xla_windowed", "xla_windowed_error", "build_error"):
        if k in w:
          r["xla_windowed_error" if k == "build_error" else k] = w[k]
      wt = w.get("timing", {})
      r.setdefault("timing", {}).update({k if k.startswith("xla_windowed") else "xla_windowed_" + k: v
                                         for k, v in wt.items()})
    results[json.dumps(list(s))] = _row(s, r)
    print(json.dumps({"shape": s, **{k: (round(v, 4) if isinstance(v, float) else v)
                                     for k, v in r.items()}}), flush=True)
    report(args, results, hdr)
  hdr["wall_s"] = round(time.time() - t_start, 1)
  for path in report(args, results, hdr):
    print("wrote", path)


if __name__ == "__main__":
  main()
