"""Where the fused overlap kernels' time goes (GPU, 2 devices, bfloat16).

Per shape (global sizes as in benchmarks/overlap.py; default the LLaMA TP=2
shapes at M=1024 and 4096) and variant it reports, ms per op:

  xla_dot          XLA's dot of the per-rank GEMM shape on one GPU
  <v>_wall         the fused op in a chain of ITERS ops per program, programs
                   back to back (as benchmarks/overlap.py times)
  <v>_kernel       CUDA-event time of the fused GEMM kernel (median over launches)
  <v>_copy         side-stream transfer (copy engine: ready wait + copy + signal;
                   SM push kernel: "push")
  <v>_host         host time of one custom-call handler (median)
  <v>_tl           medians of the device timeline summaries (see Summarize in
                   xla_ffi/overlap/profile.cc) and rank_skew, the median |first
                   tile start of rank 0 - rank 1| of the same call
with variants
  fused    the default configuration
  mailbox  readiness and addresses through the host-mapped mailbox only (the
           first version's handshake: diag_mode(MODE_MAILBOX_ONLY))
  legacy   overlap_copy_engine=False, overlap_cta_fence=False, no RS copy engine
  rs_ce    RS with overlap_rs_copy_engine_min_bytes=0 (copy engine for any block)
  rs_sm    RS with overlap_rs_copy_engine_min_bytes=-1 (NVLink stores from the epilogue)
  nocomm   the fused kernel with no waits, remote stores or transfers (its GEMM
           alone; results invalid)
fused_kernel - nocomm_kernel is the communication the overlap did not hide;
nocomm_kernel / xla_dot is our GEMM's efficiency; wall - kernel is host and
launch cost.

--timeline FILE also writes every profiled launch's whole device timeline (per
tile: start, MMA done, waits done, done, SM; per copy: ready wait, copy,
signal; per launch: host enqueue time, kernel start) for the fused, mailbox
and nocomm variants as JSON (plotted by notebooks/03_overlap.ipynb).

  python benchmarks/overlap_diag.py [--shapes ag:1024:14336:4096,rs:1024:4096:14336]
      [--variants fused,mailbox,nocomm] [--out diag.jsonl] [--timeline timeline.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overlap import chain  # noqa: E402  (benchmarks/overlap.py)

DEFAULT_SHAPES = "ag:1024:14336:4096,rs:1024:4096:14336,ag:4096:14336:4096,rs:4096:4096:14336"
VARIANTS = ["fused", "mailbox", "legacy", "rs_ce", "rs_sm", "nocomm"]
TIMELINE_VARIANTS = ("fused", "mailbox", "nocomm")


def _median(xs):
  return round(statistics.median(xs), 4) if xs else None


def run_shape(kind, M, N, K, args, timelines):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from overlap import time_per_op  # benchmarks/overlap.py: the same timing
  from jax_dfccl._src import overlap as ov
  from jax_dfccl._src import overlap_gpu as og
  import jax_dfccl

  mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
  bf = jnp.bfloat16
  if kind == "ag":
    xs, ws, os_, op = P("tp", None), P(None, "tp"), P(None, "tp"), ov.all_gather_matmul
    gm, gn, gk = M, N // 2, K
  else:
    xs, ws, os_, op = P(None, "tp"), P("tp", None), P("tp", None), ov.matmul_reduce_scatter
    gm, gn, gk = M, N, K // 2
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
  kx, kw = jax.random.split(jax.random.key(0))
  x = put(jax.random.normal(kx, (M, K), bf), xs)
  w = put((jax.random.normal(kw, (K, N), jnp.float32) / K ** 0.5).astype(bf), ws)
  it = args.iters
  r = {"shape": [kind, M, N, K], "gemm_per_rank": [gm, gn, gk], "iters": it}

  d0 = jax.devices()[0]
  a = jax.device_put(jnp.ones((gm, gk), bf), d0)
  b = jax.device_put(jnp.ones((gk, gn), bf), d0)
  r["xla_dot"], _ = time_per_op(jax.jit(chain(lambda x, w: x @ w, it)), (a, b), it, args.reps, 0.02)

  def build(bits=0, **cfg):  # transfer / fence / handshake schemes are read at trace time
    with jax_dfccl.configured(**cfg), og.fused(True), og.diag_mode(bits):
      f = jax.jit(jax.shard_map(chain(lambda x, w: op(x, w, "tp"), it), mesh=mesh,
                                in_specs=(xs, ws), out_specs=(os_,) * it))
      f.lower(x, w)
    return f

  makers = {"fused": build, "mailbox": lambda: build(og.MODE_MAILBOX_ONLY),
            "legacy": lambda: build(overlap_copy_engine=False, overlap_cta_fence=False,
                                    overlap_rs_copy_engine_min_bytes=-1),
            "rs_ce": lambda: build(overlap_rs_copy_engine_min_bytes=0),
            "rs_sm": lambda: build(overlap_rs_copy_engine_min_bytes=-1), "nocomm": build}
  for v in args.variants:
    if v.startswith("rs_") and kind != "rs":
      continue
    f = makers[v]()
    nocomm = v == "nocomm"
    og.profile(False, no_comm=nocomm)
    r[v + "_wall"], _ = time_per_op(f, (x, w), it, args.reps, 0.02)
    og.profile(True, no_comm=nocomm)
    for _ in range(args.profile_calls):
      jax.block_until_ready(f(x, w))
    og.profile(False)
    res = og.profile_results()
    ev = res["events"]
    r[v + "_kernel"] = _median([ms for k, ms in ev if k.endswith("|gemm_nocomm" if nocomm else "|gemm")])
    r[v + "_host"] = _median([ms for k, ms in ev if k.endswith("|host")])
    if not nocomm:
      r[v + "_copy"] = _median([ms for k, ms in ev if k.endswith("|push") or k.endswith("|copy")])
      tl = {}
      for k, ms in ev:
        if "|tl_" in k:
          tl.setdefault(k.split("|tl_", 1)[1], []).append(ms)
      med = {k: _median(vs) for k, vs in tl.items() if not k.startswith("start_r")}
      skew = [abs(p - q) for p, q in zip(tl.get("start_r0", []), tl.get("start_r1", []))
              if abs(p - q) < 500]  # the same call of both ranks
      if skew:
        med["rank_skew"] = _median(skew)
      r[v + "_tl"] = med
    if timelines is not None and v in TIMELINE_VARIANTS:
      timelines.append({"shape": [kind, M, N, K], "variant": v, "iters": it,
                        "calls": args.profile_calls, "wall_ms_per_op": r[v + "_wall"],
                        "timelines": res["timelines"]})
  tf = gm * gn * gk * 2 / 1e9
  for k in ("xla_dot", "fused_kernel", "nocomm_kernel"):
    if r.get(k):
      r[k + "_tflops"] = round(tf / r[k], 1)
  og.check()
  jax.clear_caches()
  return r


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--shapes", default=DEFAULT_SHAPES,
                 help="comma-separated kind:M:N:K (global sizes)")
  p.add_argument("--variants", default=VARIANTS, type=lambda s: s.split(","))
  p.add_argument("--iters", type=int, default=4, help="ops per program")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--profile-calls", type=int, default=1, help="profiled programs per variant")
  p.add_argument("--out", default=None, help="JSON lines file (one line per shape)")
  p.add_argument("--timeline", default=None, help="JSON file of the whole device timelines")
  args = p.parse_args()
  shapes = [(s.split(":")[0], *map(int, s.split(":")[1:])) for s in args.shapes.split(",")]
  timelines = [] if args.timeline else None
  for s in shapes:
    try:
      r = run_shape(*s, args, timelines)
    except Exception as e:  # noqa: BLE001
      r = {"shape": list(s), "error": f"{type(e).__name__}: {str(e)[:400]}"}
    line = json.dumps(r)
    print(line, flush=True)
    if args.out:
      with open(args.out, "a") as f:
        f.write(line + "\n")
    if args.timeline:  # after every shape: a timeout keeps what is done
      from common import header  # noqa: PLC0415
      with open(args.timeline, "w") as f:
        json.dump({"header": {**header(), "written": time.strftime("%H:%M:%S")},
                   "runs": timelines}, f)


if __name__ == "__main__":
  main()
