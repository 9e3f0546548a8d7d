"""Timing and reporting shared by every benchmark.

Per-op time is measured inside one jitted program (a chain of dependent ops,
unrolled or in lax.fori_loop), as the median over repetitions of the
wall-clock time of the whole program divided by the number of ops.
"""
from __future__ import annotations

import collections
import datetime as _dt
import glob
import gzip
import json
import os
import platform
import socket
import statistics
import sys
import time

import jax


def median_time(fn, *args, reps: int = 10, warmup: int = 2) -> float:
  """Median wall-clock seconds of ``fn(*args)`` (blocking on the result)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t)
  return statistics.median(ts)


def pipelined_time(fn, *args, reps: int = 10, depth: int = 8) -> float:
  """Median wall-clock seconds per call of ``fn(*args)`` when ``depth`` calls are enqueued back to back
  before blocking on the last: the host's per-call work (dispatch, command-buffer updates) overlaps the
  device's execution of the calls before it, so a device-bound program shows its device time."""
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    outs = [fn(*args) for _ in range(depth)]
    jax.block_until_ready(outs)
    ts.append((time.perf_counter() - t) / depth)
  return statistics.median(ts)


def donated_time(fn, x, reps: int = 10, depth: int = 8, on_settled=None) -> float:
  """Like ``pipelined_time``, for a program that donates its argument (``jax.jit(..., donate_argnums=0)``)
  and is fed its own last output, as a training step is: its parameter and result share one buffer
  and its temporaries stay where they were, so XLA replays its command buffers without updating
  them (no custom-call handler runs, no command is re-captured). Median seconds per call of
  ``reps`` rounds of ``depth`` calls, after an untimed round that settles the buffers (its first
  calls may still re-capture commands whose buffers moved); ``on_settled()`` runs between the two
  (e.g. to read counters that the timed rounds then change)."""
  y = fn(jax.numpy.copy(x))  # (x itself stays valid for the caller)
  for _ in range(depth):
    y = fn(y)
  jax.block_until_ready(y)
  if on_settled is not None:
    on_settled()
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(depth):
      y = fn(y)
    jax.block_until_ready(y)
    ts.append((time.perf_counter() - t) / depth)
  return statistics.median(ts)


def gpu_kernel_events(trace_dir: str) -> list[tuple[str, float, float]]:
  """[(name, start_us, dur_us)] of the GPU activities in a jax.profiler trace folder, by start."""
  out = []
  for fn in glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True):  # one per host
    with gzip.open(fn) as fh:
      data = json.load(fh)
    evs = data.get("traceEvents", []) if isinstance(data, dict) else data
    gpu = {e["pid"] for e in evs if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    out += [(e["name"], e["ts"], e["dur"]) for e in evs if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
  return sorted(out, key=lambda e: e[1])


def kernel_timeline(evs, anchor: str) -> dict | None:
  """Where a chain's device time goes, from its GPU activities (gpu_kernel_events): the activities whose
  name contains `anchor` (one per op of the chain) give the op's period (start to start, median); per
  activity name, the count and median duration; per pair of consecutive activities (a -> b), the median
  idle gap from a's end to b's start.  None when no activity matches the anchor."""
  ops = [e for e in evs if anchor in e[0]]
  if not ops:
    return None
  short = lambda n: n[:60]  # noqa: E731
  durs, gaps = collections.defaultdict(list), collections.defaultdict(list)
  for e in evs:
    durs[short(e[0])].append(e[2])
  for a, b in zip(evs, evs[1:]):
    gaps[f"{short(a[0])} -> {short(b[0])}"].append(b[1] - (a[1] + a[2]))
  periods = [b[1] - a[1] for a, b in zip(ops, ops[1:])]
  return {"ops": len(ops), "period_us": statistics.median(periods) if periods else None,
          "kernels": {n: {"count": len(v), "median_us": statistics.median(v)} for n, v in durs.items()},
          "gaps": {n: {"count": len(v), "median_us": statistics.median(v)} for n, v in gaps.items() if len(v) > 1}}


def machine() -> str:
  try:
    devs = jax.devices()
    kind = devs[0].device_kind
    return f"{len(devs)}x {kind} ({socket.gethostname()})"
  except Exception:  # pragma: no cover
    return platform.node()


GPU_FIELDS = ("index", "name", "pci.bus_id", "power.limit", "clocks.max.sm", "temperature.gpu")


def parse_gpu_query(text: str) -> list[dict]:
  """Rows of ``nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader`` as dicts (one per GPU)."""
  rows = []
  for line in text.strip().splitlines():
    values = [v.strip() for v in line.split(",")]
    if len(values) == len(GPU_FIELDS):
      rows.append(dict(zip(GPU_FIELDS, values)))
  return rows


def gpu_instance() -> list[dict] | None:
  """Which GPUs ran the benchmark (PCI bus, power limit, max SM clock, temperature), or None without
  nvidia-smi.  Figures of one GPU model differ by a few percent between machines and power states, so a
  result names its instance."""
  import shutil
  import subprocess
  if shutil.which("nvidia-smi") is None:
    return None
  try:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.SubprocessError):
    return None
  return parse_gpu_query(out.stdout) if out.returncode == 0 else None


def header(command: str | None = None) -> dict:
  doc = {
      "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "machine": machine(),
      "jax": jax.__version__,
      "command": command or " ".join([os.path.basename(sys.executable), *sys.argv]),
  }
  gpus = gpu_instance()
  if gpus is not None:
    doc["gpus"] = gpus
  return doc


def parse_sizes(text: str) -> list[int]:
  """Comma-separated byte counts with an optional K / M / G suffix (binary): "4K,1.5M,64"."""
  unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
  return [int(float(t[:-1]) * unit[t[-1].upper()]) if t[-1].upper() in unit else int(t)
          for t in text.split(",") if t]


def parse_config(text: str) -> dict:
  """``--config`` of the benchmarks: comma-separated jax_dfccl.config entries, "name=value,..."
  (numbers, or a name such as ``cross_host_transport=nvshmem``)."""
  def value(v: str):
    try:
      return float(v)
    except ValueError:
      return v
  return {k: value(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def testbed_header(benchmark: str, device: str | None) -> dict:
  """The header of a result of the processes of ``tools/mps_testbed.sh`` (machine from the GPU the
  ranks report, not jax.devices(): such a benchmark may create no JAX backend)."""
  return {
      "benchmark": benchmark,
      "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "machine": f"{device or 'no GPU'} ({socket.gethostname()}, {platform.machine()})",
      "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
      "launcher": "tools/mps_testbed.sh" if "DFCCL_TESTBED_RANK" in os.environ else None,
      "mps": {"1": True, "0": False}.get(os.environ.get("DFCCL_TESTBED_MPS", ""), None),
      "gpus": gpu_instance(),
  }


def write_json(path: str, doc: dict):
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(doc, f, indent=1)


def write_results(name: str, payload: dict, markdown: str, outdir: str | None = None) -> tuple[str, str]:
  """Writes ``<outdir>/<name>.json`` and ``.md`` (default: benchmarks/results)."""
  outdir = outdir or os.path.join(os.path.dirname(__file__), "results")
  os.makedirs(outdir, exist_ok=True)
  jp, mp = os.path.join(outdir, name + ".json"), os.path.join(outdir, name + ".md")
  with open(jp, "w") as f:
    json.dump(payload, f, indent=1)
  hdr = payload.get("header", {})
  with open(mp, "w") as f:
    f.write(f"# {name}\n\n")
    for k in ("date", "machine", "jax", "command"):
      if k in hdr:
        f.write(f"- {k}: `{hdr[k]}`\n")
    f.write("\n" + markdown + "\n")
  return jp, mp


def md_table(headers, rows) -> str:
  out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(out)


class KvExchange:
  """Bytes and barriers between the processes of one job (``tools/mps_testbed.sh``) through
  jax.distributed's key-value store, as the runtime's own bootstrap uses it; keys under ``prefix``.
  Initializes jax.distributed (no JAX backend is created)."""

  def __init__(self, coord: str, nproc: int, rank: int, prefix: str):
    import jax  # noqa: PLC0415 - after the caller's XLA_* environment
    from jax._src import distributed  # noqa: PLC0415
    jax.distributed.initialize(coordinator_address=coord, num_processes=nproc, process_id=rank,
                               initialization_timeout=60, shutdown_timeout_seconds=30)
    self._jax, self._c, self._prefix = jax, distributed.global_state.client, prefix

  def put(self, key: str, value: bytes):
    self._c.key_value_set_bytes(f"{self._prefix}/{key}", value)

  def get(self, key: str, timeout_s: float = 120.0) -> bytes:
    return bytes(self._c.blocking_key_value_get_bytes(f"{self._prefix}/{key}", int(timeout_s * 1000)))

  def barrier(self, name: str, timeout_s: float = 300.0):
    self._c.wait_at_barrier(f"{self._prefix}/{name}", int(timeout_s * 1000))

  def close(self):
    self._jax.distributed.shutdown()

