"""The fused overlap GEMM alone on one GPU, against XLA's dot (cuBLAS).

The per-rank GEMMs of benchmarks/overlap.py (TP=2 Megatron shards: AG+GEMM
(M, K) @ (K, N/2), GEMM+RS (M, K/2) @ (K/2, N)), bfloat16, ms per op:

  xla_dot     jnp.dot under jax.jit (what t_gemm measures in overlap.py)
  fused_1x1   the fused kernel of xla_ffi/overlap over a one-GPU axis (a group
              of one rank: no communication, the GEMM with its scheduler and
              epilogue), one CTA per tile, default configuration (the tile
              width picked per shape, a partial last wave's tiles split
              along k where the host's heuristic picks it)
  fused_t128, fused_t192, fused_t256
              fused_1x1 with jax_dfccl.config.overlap.tile_n forced to that
              width (128-row tiles)
  fused_dp    the same with jax_dfccl.config.overlap.split_last_wave = False
              (whole tiles only: the previous schedule)
  fused_2x1   overlap_cluster_m = 2 (pairs of tiles on 2x1 clusters, the
              weight tile multicast to both; no split)
  fused_auto  overlap_cluster_m = 0: the host picks 1x1 (with the split) when
              the last wave is split or the tiles fit in one wave, else 2x1
  fused_nopdl fused_1x1 with jax_dfccl.config.overlap.pdl = False (plain
              stream order: no launch before the previous kernel's end)
  fused_r1 ... fused_r6
              fused_1x1 with jax_dfccl.config.overlap.raster = 1 ... 6 (the
              order of a row block's tiles forced: protocol.h kRasters);
              fused_2x1_r1 ... fused_2x1_r6 the same with 2x1 clusters
  fused_tma   fused_1x1 with jax_dfccl.config.overlap.tma_store = True (the
              epilogue's bulk tensor stores on every shape); fused_notma
              the same with False (the threads' stores on every shape;
              fused_1x1 leaves the choice to the plan)
  fused_pp    fused_1x1 with jax_dfccl.config.overlap.pingpong = True (the
              ping-pong schedule: 128-column tiles, each consumer warp group
              a tile of its own, one's epilogue under the other's mainloop);
              fused_1x1 is the default, the cooperative schedule

Timing as in overlap.py (a chain of dependent ops per program, programs
called back to back), but the variants of a shape take turns rep by rep
(--interleave, default: drift of the GPU's clocks over a run hits them
alike; each rep starts with the next variant; each timed block follows an
untimed block of the same variant, so no variant is timed in the power state
its predecessor left); median over reps.  Needs
one sm90 GPU.


  python benchmarks/overlap_gemm.py --tag h200 --outdir $OUT [--profile] [--m-nk0 512,1024,2048,4096,8192]

--m-nk0 gives the M values of the first (LLaMA-3-8B) shape pair (an M sweep);
the other pairs keep --m.  The ratio column is fused_1x1 / xla_dot.

--profile also traces one call of each chain (jax.profiler) and reports the
GEMM kernel's own time and the GPU's idle gap between consecutive GEMMs.

Each row also records what XLA made of its dot (`xla_dot_impl`: cuBLAS, or
Triton with the tiling its autotuner chose), listed after the table.

--cutlass-probe BINARY (tools/cutlass_gemm_probe.cu, built with the line in
its header) also times stock CUTLASS's sm90 GEMMs on the same shapes, timed
the same way, in a process of its own after this one's timing; the table gets
the best of its configurations per shape and that time / xla_dot's.
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys

VARIANTS = ["xla_dot", "fused_1x1", "fused_t128", "fused_t192", "fused_t256", "fused_dp", "fused_2x1", "fused_auto",
            "fused_nopdl"]


def build(kind, M, N, K, names, iters):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P

  import jax_dfccl
  from jax_dfccl._src import overlap_gpu as og
  from overlap import chain  # benchmarks/ (on sys.path, main)

  m, n, k = (M, N // 2, K) if kind == "ag" else (M, N, K // 2)
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
  mesh = Mesh(np.array(jax.devices()[:1]), ("one",))

  def fused(cluster_m, split=True, pdl=True, tile_n=0, raster=0, tma_store=None, pingpong=False):
    if kind == "ag":
      body = lambda x, w: og.all_gather_matmul(x, w, "one", 1)[0]  # noqa: E731
    else:
      body = lambda x, w: og.matmul_reduce_scatter(x, w, "one", 1)  # noqa: E731
    f = jax.jit(jax.shard_map(chain(body, iters), mesh=mesh, in_specs=(P(), P()), out_specs=(P(),) * iters))
    with jax_dfccl.configured(overlap_cluster_m=cluster_m, overlap_split_last_wave=split, overlap_pdl=pdl,
                              overlap_tile_n=tile_n, overlap_raster=raster, overlap_tma_store=tma_store,
                              overlap_pingpong=pingpong):
      lowered = f.lower(x, w)
    if "dfccl_overlap_" not in lowered.as_text():
      raise RuntimeError("fused kernel not used")
    return lowered.compile(), (x, w)

  makers = {"xla_dot": lambda: (jax.jit(chain(jnp.dot, iters)), (x, w)),
            "fused_1x1": lambda: fused(1), "fused_dp": lambda: fused(1, False), "fused_2x1": lambda: fused(2),
            "fused_auto": lambda: fused(0), "fused_nopdl": lambda: fused(1, pdl=False),
            "fused_t128": lambda: fused(1, tile_n=128), "fused_t192": lambda: fused(1, tile_n=192),
            "fused_t256": lambda: fused(1, tile_n=256)}
  makers.update({f"fused_r{r}": (lambda r=r: fused(1, raster=r)) for r in range(1, 7)})
  makers.update({f"fused_2x1_r{r}": (lambda r=r: fused(2, raster=r)) for r in range(1, 7)})
  makers["fused_tma"] = lambda: fused(1, tma_store=True)
  makers["fused_notma"] = lambda: fused(1, tma_store=False)
  makers["fused_pp"] = lambda: fused(1, pingpong=True)
  return {v: makers[v] for v in names}, (m, n, k)


def default_plan(kind, m, n, k):
  """The default configuration's launch plan of this one-rank GEMM (tile width, split; plan.cc PlanLaunch)."""
  import jax

  from jax_dfccl._src import overlap_gpu as og
  sms = getattr(jax.devices()[0], "core_count", None) or 132
  return og.module().plan(1, m, n, k, sms, sms, og._mode(og._config(), kind, 1, 0), kind)


def interleaved(fns, iters, reps, min_rep_s):
  """({name: ms per op}, {name: [ms per op of each rep]}) for {name: (fn, args)}: per rep every variant
  once, in turn (rep r starts with the r-th variant: none always follows the same one); median over reps."""
  import math
  import time

  import jax
  calls = {}
  for v, (f, a) in fns.items():
    jax.block_until_ready(f(*a))  # compile + first run
    t = time.perf_counter()
    jax.block_until_ready(f(*a))
    calls[v] = max(1, min(64, math.ceil(min_rep_s / max(time.perf_counter() - t, 1e-6))))
  ts = {v: [] for v in fns}
  names = list(fns)
  for r in range(reps):
    for v in names[r % len(names):] + names[: r % len(names)]:
      f, a = fns[v]
      # The same calls untimed first: the timed ones then run in the GPU state (clocks under the power
      # limit) that this variant itself brings about, not the one its predecessor left.
      jax.block_until_ready([f(*a) for _ in range(calls[v])])
      t = time.perf_counter()
      out = None
      for _ in range(calls[v]):
        out = f(*a)
      jax.block_until_ready(out)
      ts[v].append((time.perf_counter() - t) / (calls[v] * iters))
  return {v: statistics.median(x) * 1e3 for v, x in ts.items()}, {v: [t * 1e3 for t in x] for v, x in ts.items()}


def paired_ratios(per_rep, base="xla_dot"):
  """{variant: median over reps of (its ms / base's ms in the same rep)}: every rep times each variant once,
  close together, so drift of the GPU's clocks from rep to rep (a power-limited GPU: up to 5% for the
  identical kernel) cancels in the ratio, which a ratio of the two medians keeps."""
  if base not in per_rep:
    return {}
  b = per_rep[base]
  return {v: statistics.median(x / y for x, y in zip(xs, b)) for v, xs in per_rep.items()
          if v != base and len(xs) == len(b) and b}


def gemm_kernel_stats(evs):
  """The GEMM of traced GPU activities (the kernel with the most time) and the rest: its median duration, the
  median idle gap between consecutive GEMMs and the start-to-start period (us), or None without activities."""
  if not evs:
    return None
  name = max({e[0] for e in evs}, key=lambda n: sum(e[2] for e in evs if e[0] == n))
  ks = [e for e in evs if e[0] == name]
  gaps = [b[1] - (a_[1] + a_[2]) for a_, b in zip(ks, ks[1:])]
  # Start to start: with programmatic launch a kernel starts (and waits) before its predecessor
  # ends, so its duration includes that wait and the gap is negative; the period is the cost.
  periods = [b[1] - a_[1] for a_, b in zip(ks, ks[1:])]
  return {"kernel": name[:120], "kernels": len(ks), "kernel_us": statistics.median(e[2] for e in ks),
          "gap_us": statistics.median(gaps) if gaps else None,
          "period_us": statistics.median(periods) if periods else None,
          "max_period_us": max(periods) if periods else None,
          "other_activities": dict(collections.Counter(e[0][:60] for e in evs if e[0] != name))}


def chain_profile(f, a, trace_dir):
  """One traced call of a chain: gemm_kernel_stats of its GPU activities."""
  import jax
  from common import gpu_kernel_events  # noqa: PLC0415
  with jax.profiler.trace(trace_dir):
    jax.block_until_ready(f(*a))
  return gemm_kernel_stats(gpu_kernel_events(trace_dir))


def _json_object_at(text, start):
  """The JSON object that begins at text[start] ("{"), parsed (balanced braces; strings hold none)."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth == 0:
      return json.loads(text[start:i + 1])
  raise ValueError("unbalanced JSON object")


def xla_dot_impl(hlo_text):
  """How XLA implemented the dots of an optimized HLO module (`compiled.as_text()`): {"impl": "cublas", "triton",
  "cudnn", "xla" (its own emitter) or another library call's target; "config": the Triton tiling where XLA's
  autotuner chose one; "gemms": how many}, or None where the module holds no dot.  A Triton GEMM's operand
  fusions carry the GEMM's fusion kind too: only the fusions calling a `gemm_fusion` computation count."""
  lines = hlo_text.splitlines()
  calls = [m.group(1) for ln in lines for m in [re.search(r'custom_call_target="([^"]+)"', ln)]
           if m and re.search(r"cublas|matmul|gemm", m.group(1), re.IGNORECASE)]
  if calls:
    return {"impl": "cublas" if all("cublas" in t for t in calls) else calls[0], "target": calls[0],
            "gemms": len(calls)}
  legacy = [ln for ln in lines if '"kind":"__triton_gemm"' in ln]
  if legacy:
    c = _json_object_at(legacy[0], legacy[0].index('"triton_gemm_config":') + len('"triton_gemm_config":'))
    return {"impl": "triton", "config": f"{c['block_m']}x{c['block_n']}x{c['block_k']}, split_k {c['split_k']}, "
                                        f"{c['num_stages']} stages, {c['num_warps']} warps", "gemms": len(legacy)}
  nested = [ln for ln in lines if '"kind":"__triton_nested_gemm_fusion"' in ln]
  outer = [ln for ln in nested if re.search(r"calls=%?gemm_fusion", ln)] or nested[:1]
  if outer:
    key = '"block_level_fusion_config":'
    c = _json_object_at(outer[0], outer[0].index(key) + len(key)) if key in outer[0] else {}
    tile = "x".join(c.get("output_tiles", [{}])[0].get("sizes", [])) or "?"
    return {"impl": "triton", "config": f"{tile}, {c.get('num_stages', '?')} stages, {c.get('num_warps', '?')} warps",
            "gemms": len(outer)}
  cudnn = [ln for ln in lines if '"kind":"__cudnn$fusion"' in ln]
  if cudnn:
    return {"impl": "cudnn", "gemms": len(cudnn)}
  dots = [ln for ln in lines if re.search(r"=\s*\S+\s+dot\(", ln)]
  return {"impl": "xla", "gemms": len(dots)} if dots else None


def parse_cutlass_probe(text):
  """{"MxNxK": {configuration: us}} from the output of tools/cutlass_gemm_probe.cu (a shape line, then one
  line per configuration: name, us, TFLOP/s; "cannot implement" lines are left out)."""
  out, shape = {}, None
  for line in text.splitlines():
    if re.fullmatch(r"\d+x\d+x\d+", line.strip()):
      shape = line.strip()
      out[shape] = {}
      continue
    m = re.match(r"^\s+(\S.*?)\s+([\d.]+) us\s+\d+ TFLOP/s", line)
    if m and shape is not None:
      out[shape][m.group(1)] = float(m.group(2))
  return out


def add_cutlass(rows, probe_us):
  """Each row's stock CUTLASS times (`cutlass_us`) and the best configuration against XLA's dot of the row."""
  for r in rows:
    us = probe_us.get("x".join(map(str, r["gemm"])))
    if not us:
      continue
    best = min(us, key=us.get)
    r["cutlass_us"] = us
    r["cutlass_best"] = {"config": best, "ms": us[best] / 1e3}
    if r["ms"].get("xla_dot"):
      r["cutlass_best"]["vs_xla_dot"] = us[best] / 1e3 / r["ms"]["xla_dot"]


def run_cutlass_probe(binary, rows, timeout_s):
  """Runs the stock CUTLASS probe (--steady, timed like this benchmark) on the rows' GEMMs in a process of
  its own, after this one's timing, and adds its times to the rows; its output is returned for the log."""
  shapes = list(dict.fromkeys("x".join(map(str, r["gemm"])) for r in rows))
  res = subprocess.run([binary, "--steady", *shapes], capture_output=True, text=True, timeout=timeout_s)
  if res.returncode != 0:
    raise RuntimeError(f"{binary} exited with {res.returncode}: {res.stderr[-500:]}")
  add_cutlass(rows, parse_cutlass_probe(res.stdout))
  return res.stdout


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--ops", default="ag,rs", type=lambda s: s.split(","))
  p.add_argument("--m", default=[1024, 4096, 8192], type=lambda s: [int(v) for v in s.split(",")])
  p.add_argument("--nk", default=[0, 1, 2], type=lambda s: [int(v) for v in s.split(",")])
  p.add_argument("--m-nk0", default=None, type=lambda s: [int(v) for v in s.split(",")],
                 help="M values for the first (N, K) pair instead of --m (the LLaMA-3-8B M sweep)")
  p.add_argument("--variants", default=VARIANTS, type=lambda s: s.split(","))
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--no-interleave", dest="interleave", action="store_false",
                 help="time each variant's reps back to back (as overlap.py) instead of in turns")
  p.add_argument("--min-rep-ms", type=float, default=30.0)
  p.add_argument("--tag", default="local")
  p.add_argument("--outdir", default=None, help="default benchmarks/results")
  p.add_argument("--cutlass-probe", default=None, metavar="BINARY",
                 help="also time stock CUTLASS (tools/cutlass_gemm_probe.cu, built with the line in its header) on"
                      " the same GEMMs, in its own process after this one's timing: the best of its configurations"
                      " per shape goes into the table")
  p.add_argument("--cutlass-timeout-s", type=float, default=600.0)
  p.add_argument("--profile", action="store_true",
                 help="also trace one call of each chain: GEMM kernel time and the GPU's idle gap between GEMMs")
  args = p.parse_args()
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path.insert(0, os.path.join(here, ".."))
  sys.path.insert(0, here)
  import jax

  from overlap import AG_NK, RS_NK, plan, time_per_op

  rows = []
  for i in args.nk:
    for M in (args.m_nk0 if i == 0 and args.m_nk0 else args.m):
      for kind in args.ops:
        N, K = (AG_NK if kind == "ag" else RS_NK)[i]
        iters, _ = plan(kind, M, N, K)
        makers, (m, n, k) = build(kind, M, N, K, args.variants, iters)
        row = {"kind": kind, "M": M, "N": N, "K": K, "gemm": [m, n, k], "ms": {}, "tflops": {}}
        try:
          row["plan"] = default_plan(kind, m, n, k)
        except Exception as e:  # noqa: BLE001
          row.setdefault("errors", {})["plan"] = f"{type(e).__name__}: {e}"[:300]
        built = {}
        for v, make in makers.items():
          try:
            f, a = make()
            built[v] = (f, a)
            if v == "xla_dot":  # what XLA made of the dot (cuBLAS or a Triton tiling: its autotuner's choice)
              try:
                row["xla_dot_impl"] = xla_dot_impl(f.lower(*a).compile().as_text())
              except Exception as e:  # noqa: BLE001  (recorded; the timing does not depend on it)
                row.setdefault("errors", {})["xla_dot_impl"] = f"{type(e).__name__}: {e}"[:300]
            if not args.interleave:
              row["ms"][v], _ = time_per_op(f, a, iters, args.reps, args.min_rep_ms / 1e3)
          except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
            row["ms"][v] = None
            row.setdefault("errors", {})[v] = f"{type(e).__name__}: {e}"[:300]
        if args.interleave and built:
          try:
            med, per_rep = interleaved(built, iters, args.reps, args.min_rep_ms / 1e3)
            row["ms"].update(med)
            row["ms_per_rep"] = per_rep
            row["paired_vs_xla_dot"] = paired_ratios(per_rep)
          except Exception as e:  # noqa: BLE001
            row.setdefault("errors", {})["interleaved"] = f"{type(e).__name__}: {e}"[:300]
            built = {}
        for v, (f, a) in built.items():
          try:
            ms = row["ms"][v]
            row["tflops"][v] = 2 * m * n * k / (ms * 1e-3) / 1e12
            if args.profile:
              import tempfile  # noqa: PLC0415
              row.setdefault("profile", {})[v] = chain_profile(f, a, tempfile.mkdtemp())
          except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
            row["ms"][v] = None
            row.setdefault("errors", {})[v] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
  probe_log = None
  if args.cutlass_probe:
    try:
      probe_log = run_cutlass_probe(args.cutlass_probe, rows, args.cutlass_timeout_s)
    except Exception as e:  # noqa: BLE001  (recorded, the run's own results are kept)
      probe_log = f"cutlass probe failed: {type(e).__name__}: {e}"[:1000]
      print(probe_log, flush=True)
  now = dt.datetime.now(dt.timezone.utc)
  dev = jax.devices()[0]
  meta = {"date": now.isoformat(timespec="seconds"), "device": getattr(dev, "device_kind", str(dev)),
          "interleave": args.interleave, "reps": args.reps, "min_rep_ms": args.min_rep_ms,
          "jax": jax.__version__, "command": "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:])}
  from common import gpu_instance  # noqa: PLC0415
  gpus = gpu_instance()
  if gpus is not None:
    meta["gpus"] = gpus  # the instance: ratios to XLA's dot moved ~3% between two H200 machines
  outdir = args.outdir or os.path.join(here, "results")
  os.makedirs(outdir, exist_ok=True)
  base = os.path.join(outdir, f"overlap_gemm_{now:%Y-%m-%d}_{args.tag}")
  if probe_log is not None:
    meta["cutlass_probe"] = {"command": f"{args.cutlass_probe} --steady SHAPES", "output": probe_log}
  with open(base + ".json", "w") as fh:
    json.dump({"meta": meta, "rows": rows}, fh, indent=1)
  cut = any("cutlass_best" in r for r in rows)
  lines = [f"# Fused overlap GEMM alone vs XLA dot ({meta['device']}, {meta['date']})", "",
           f"`{meta['command']}` (jax {meta['jax']}); ms per op (TFLOP/s), bfloat16, per-rank GEMM of TP=2.", "",
           ("Variants in turns rep by rep, " if args.interleave else "Variants one after another, ")
           + f"median of {args.reps} reps of at least {args.min_rep_ms:g} ms.", "",
           "`plan`: the default configuration's tile width (`pp`: the ping-pong schedule) and, where a partial last"
           " wave is split, its tiles x"
           " chunks (xla_ffi/overlap/plan.cc PlanLaunch).", "",
           "`fused_1x1 / xla_dot`: the ratio of the two medians; `paired`: the median over reps of the ratio within"
           " each rep (drift of the clocks between reps cancels).", "",
           *(["`stock CUTLASS`: the best of the configurations of tools/cutlass_gemm_probe.cu (--steady, the"
              " same timing, in its own process after this one's) and its time / xla_dot's median.", ""]
             if cut else []),
           "| op | M | N | K | GEMM m x n x k | plan | " + " | ".join(args.variants) + " | fused_1x1 / xla_dot |"
           + " paired |" + (" fused_auto / xla_dot |" if "fused_auto" in args.variants else "")
           + (" stock CUTLASS | CUTLASS / xla_dot |" if cut else ""),
           "|---|---|---|---|---|---|" + "---|" * (len(args.variants) + 2 + ("fused_auto" in args.variants)
                                                   + 2 * cut)]
  for r in rows:
    cells = [f"{r['ms'][v]:.3f} ({r['tflops'][v]:.0f})" if r["ms"].get(v) else "err" for v in args.variants]
    ratio = (f"{r['ms']['fused_1x1'] / r['ms']['xla_dot']:.3f}"
             if r["ms"].get("fused_1x1") and r["ms"].get("xla_dot") else "-")
    paired = r.get("paired_vs_xla_dot", {}).get("fused_1x1")
    ratio += f" | {paired:.3f}" if paired else " | -"
    if "fused_auto" in args.variants:
      ratio += (f" | {r['ms']['fused_auto'] / r['ms']['xla_dot']:.3f}"
                if r["ms"].get("fused_auto") and r["ms"].get("xla_dot") else " | -")
    if cut:
      cb = r.get("cutlass_best")
      ratio += (f" | {cb['ms']:.3f} ({cb['config']}) | " + (f"{cb['vs_xla_dot']:.3f}" if "vs_xla_dot" in cb else "-")
                if cb else " | - | -")
    pl = r.get("plan")
    plan_cell = "-" if not pl else f"{pl['tile_n']}" + (" pp" if pl.get("pingpong") else "") + (
        f", {pl['sk_tiles']}x{pl['sk_units'] // pl['sk_tiles']}" if pl["sk_units"] else "")
    lines.append(f"| {r['kind']} | {r['M']} | {r['N']} | {r['K']} | {'x'.join(map(str, r['gemm']))} | {plan_cell} | "
                 + " | ".join(cells) + f" | {ratio} |")
  if any(r.get("xla_dot_impl") for r in rows):
    lines += ["", "XLA's dot as XLA compiled it (the optimized HLO of the xla_dot chain):", "",
              "| op | M | N | K | implementation |", "|---|---|---|---|---|"]
    for r in rows:
      d = r.get("xla_dot_impl")
      lines.append(f"| {r['kind']} | {r['M']} | {r['N']} | {r['K']} | "
                   + ("-" if not d else d["impl"] + (f" {d['config']}" if d.get("config") else "")) + " |")
  if args.profile:
    lines += ["", "Traced chains: GEMM kernel us / GPU idle gap between consecutive GEMMs us / start-to-start"
              " period us (median)", "",
              "| op | M | N | K | " + " | ".join(args.variants) + " |", "|---|---|---|---|" + "---|" * len(args.variants)]
    for r in rows:
      pr = r.get("profile", {})
      cells = [f"{pr[v]['kernel_us']:.1f} / {pr[v]['gap_us']:.1f} / {pr[v]['period_us']:.1f}"
               if pr.get(v) and pr[v]["gap_us"] is not None
               else "-" for v in args.variants]
      lines.append(f"| {r['kind']} | {r['M']} | {r['N']} | {r['K']} | " + " | ".join(cells) + " |")
  with open(base + ".md", "w") as fh:
    fh.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
