"""The performance plots of docs/performance.md, made from the committed JSON results.

    python benchmarks/plots.py [--results benchmarks/results] [--out docs/images/performance]

Each figure names the result files it reads (in its title or caption); the output is
deterministic for a given matplotlib (no timestamps or software tags in the PNGs), so the
committed images change only when the results or this script do.
"""
from __future__ import annotations

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: figure name -> the result files it reads (docs/performance.md cites the same files).
SOURCES = {
    "collectives_h200x2.png": ["collectives_2026-11-30_h200x2_one_call.json",
                               "collectives_2026-12-01_h200x2_combine.json"],
    "overlap_h200x2.png": ["overlap_2026-11-30_h200x2.json"],
    "fused_gemm_h200.png": ["overlap_gemm_2026-12-04_h200_impl.json"],
    "multiprocess_cpu.png": ["multiprocess_cpu_2026-12-01_p2d2.json"],
}
OPS = ("psum", "all_gather", "psum_scatter", "all_to_all")


def _load(results: pathlib.Path, name: str):
  return json.loads((results / name).read_text())


def _size(b: int) -> str:
  for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
    if b >= 1 << shift:
      return f"{b >> shift} {unit}"
  return f"{b} B"


def collectives(results, plt):
  """Bus bandwidth per op and size, jax_dfccl and jax.lax in the same run (2xH200, bf16, chains of
  dependent ops in one jit, unrolled). Sizes below 16 MiB from the one-call run, from 16 MiB on
  from the run in today's default configuration (copy engines)."""
  small = _load(results, SOURCES["collectives_h200x2.png"][0])["rows"]
  large = _load(results, SOURCES["collectives_h200x2.png"][1])["rows"]
  rows = [r for r in small if r["bytes"] < 16 << 20] + large
  fig, axes = plt.subplots(1, 4, figsize=(14, 3.4), sharey=True)
  for ax, op in zip(axes, OPS):
    rs = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
    x = [r["bytes"] for r in rs]
    ax.plot(x, [r["dfccl/unrolled/busbw_GBs"] for r in rs], "o-", label="jax_dfccl")
    ax.plot(x, [r["jax.lax/unrolled/busbw_GBs"] for r in rs], "s--", label="jax.lax (NCCL)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([_size(b) for b in x], rotation=45, fontsize=7)
    ax.set_title(op, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
  axes[0].set_ylabel("bus bandwidth (GB/s)")
  axes[0].legend(fontsize=8)
  fig.suptitle("Collectives on 2xH200 (bf16, per device buffer size)", fontsize=11)
  fig.tight_layout()
  return fig


def overlap(results, plt):
  """Fused GEMM + communication against the GEMM alone and the best of XLA (2xH200, TP=2, bf16)."""
  rows = _load(results, SOURCES["overlap_h200x2.png"][0])["rows"]
  labels = [f"{r['kind'].upper()} {r['M']}x{r['N']}x{r['K']}" for r in rows]
  best = [min(r["xla_plain"], r["xla_windowed"]) for r in rows]
  fig, ax = plt.subplots(figsize=(12, 3.8))
  ys = [b / r["ours_fused"] for b, r in zip(best, rows)]
  gemm = [b / r["t_gemm"] for b, r in zip(best, rows)]
  idx = list(range(len(rows)))
  ax.bar([i - 0.2 for i in idx], ys, width=0.4, label="best XLA / fused (ours)")
  ax.bar([i + 0.2 for i in idx], gemm, width=0.4, label="best XLA / GEMM alone (no communication)",
         alpha=0.5)
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xticks(idx)
  ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
  ax.set_ylabel("speed-up over best XLA")
  ax.legend(fontsize=8)
  ax.set_title("All-gather + GEMM (AG) and GEMM + reduce-scatter (RS), 2xH200, TP=2, bf16", fontsize=10)
  fig.tight_layout()
  return fig


def fused_gemm(results, plt):
  """The fused kernel's GEMM alone (one H200, no communication) against XLA's dot, per shape."""
  rows = _load(results, SOURCES["fused_gemm_h200.png"][0])["rows"]
  labels = [f"{r['kind'].upper()} {'x'.join(str(v) for v in r['gemm'])}" for r in rows]
  ratio = [r["ms"]["fused_1x1"] / r["ms"]["xla_dot"] for r in rows]
  fig, ax = plt.subplots(figsize=(12, 3.6))
  ax.bar(range(len(rows)), ratio)
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_ylim(0.9, max(ratio) + 0.03)
  ax.set_xticks(range(len(rows)))
  ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
  ax.set_ylabel("time / XLA's dot")
  ax.set_title("The fused GEMM alone on one H200 (per-rank shapes), relative to XLA's dot", fontsize=10)
  fig.tight_layout()
  return fig


def multiprocess_cpu(results, plt):
  """A chain of dependent 4 KiB pmeans on CPU, one process (4 devices) and two (2 x 2 devices)."""
  d = _load(results, SOURCES["multiprocess_cpu.png"][0])["latency"]
  groups = [("one process\n4 devices", d["one_process"]), ("two processes\n2 devices each", d["multi_process"])]
  fig, ax = plt.subplots(figsize=(6, 3.4))
  width = 0.27
  for i, (key, label) in enumerate((("dfccl_us", "jax_dfccl"), ("lax_us", "jax.lax"),
                                    ("no_collective_us", "no collective"))):
    ax.bar([g + (i - 1) * width for g in range(len(groups))], [v[key] for _, v in groups], width,
           label=label)
  ax.set_yscale("log")
  ax.set_xticks(range(len(groups)))
  ax.set_xticklabels([g for g, _ in groups])
  ax.set_ylabel("µs per op (log)")
  ax.legend(fontsize=8)
  ax.set_title("4 KiB pmean chain on a 2-core CPU", fontsize=10)
  fig.tight_layout()
  return fig


FIGURES = {"collectives_h200x2.png": collectives, "overlap_h200x2.png": overlap,
           "fused_gemm_h200.png": fused_gemm, "multiprocess_cpu.png": multiprocess_cpu}


def main(argv=None) -> list[pathlib.Path]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--results", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
  ap.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "images" / "performance")
  args = ap.parse_args(argv)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  plt.rcParams.update({"svg.hashsalt": "jax_dfccl", "font.size": 9})
  args.out.mkdir(parents=True, exist_ok=True)
  written = []
  for name, make in FIGURES.items():
    fig = make(args.results, plt)
    path = args.out / name
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    written.append(path)
    print(path)
  return written


if __name__ == "__main__":
  main()
