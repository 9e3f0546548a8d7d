"""Do jax_dfccl's collectives sit inside XLA's command buffers (CUDA graphs)?

Compiles, on one GPU, a chain of elementwise work and jax_dfccl collectives
(a group of one forced through the runtime, ``config.testing.runtime_for_groups_of_one``)
with ``--xla_dump_to``, then reads the optimized HLO XLA dumped: which
computations are command buffers and which custom calls they hold.  Then runs
the program and reports per-op time and the handlers' calls per executed
collective (1.0: a handler ran for every collective; close to 0: XLA replayed a
recorded command buffer without calling them).

  python tools/cmdbuf_probe.py --dump /tmp/dump [--json out.json]
Run it twice to compare with command buffers off:
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python tools/cmdbuf_probe.py ...
(the script appends its dump flag to XLA_FLAGS).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time


def _hlo_command_buffers(dump: str) -> dict:
  files = sorted(glob.glob(os.path.join(dump, "*after_optimizations.txt")))
  thunks = sorted(glob.glob(os.path.join(dump, "*thunk_sequence*.txt")))
  out = {"files": [os.path.basename(f) for f in files + thunks], "command_buffers": [], "custom_calls_outside": [],
         "thunk_kinds": {}}
  for f in thunks:  # e.g. kCommandBuffer / kCustomCall lines of the executable's thunk sequence
    kinds = re.findall(r"\b(k[A-Z]\w+)\b", open(f).read())
    out["thunk_kinds"][os.path.basename(f)] = {k: kinds.count(k) for k in sorted(set(kinds))}
  for f in files:
    text = open(f).read()
    comps = re.split(r"\n(?=\S)", text)
    inside = set()
    for comp in comps:
      head = comp.split("\n", 1)[0]
      m = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)", head)
      if not m:
        continue
      name = m.group(1)
      targets = re.findall(r'custom_call_target="([^"]+)"', comp)
      if "command_buffer" in name:
        out["command_buffers"].append({"file": os.path.basename(f), "name": name,
                                       "instructions": comp.count("\n"), "custom_calls": targets})
        inside.update(i for i, _ in enumerate(targets))
      else:
        out["custom_calls_outside"] += [t for t in targets if t.startswith("dfccl")]
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--dump", required=True)
  ap.add_argument("--json", default=None)
  ap.add_argument("--ops", type=int, default=32, help="collectives in the chain")
  ap.add_argument("--elems", type=int, default=1024, help="f32 elements per collective (4 KiB)")
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump}"
                             " --xla_dump_hlo_module_re=.*body.*").strip()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P

  import jax_dfccl as d
  d.config.testing.runtime_for_groups_of_one = True
  mesh = Mesh(np.array(jax.devices()[:1]), ("x",))

  def body(v):
    for i in range(args.ops):
      v = jnp.sin(v) * 1.0001 + 0.5  # a fusion between collectives
      v = d.psum(v, "x", key=f"probe/{i}")
    return v

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
  x = jnp.arange(args.elems, dtype=jnp.float32) / args.elems
  want = x
  for _ in range(args.ops):
    want = jnp.sin(want) * 1.0001 + 0.5
  got = f(x).block_until_ready()
  exact = bool(np.allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6))
  s0 = d.stats()["cuda"]
  t0 = time.perf_counter()
  for _ in range(args.iters):
    got = f(got)
  got.block_until_ready()
  dt = (time.perf_counter() - t0) / args.iters
  s1 = d.stats()["cuda"]
  ran = s1["started"] - s0["started"]
  calls = s1["host_calls"] - s0["host_calls"]
  # host_start_us is a mean over calls; the call count is what the handlers saw.
  report = {
      "xla_flags": os.environ["XLA_FLAGS"], "jax": jax.__version__, "device": jax.devices()[0].device_kind,
      "ops_per_program": args.ops, "executions": args.iters, "collectives_run": ran,
      "exact_first_run": exact, "us_per_op": dt / args.ops * 1e6,
      "handler_calls_per_collective": calls / max(ran, 1),
      "hlo": _hlo_command_buffers(args.dump),
  }
  try:
    from jax_dfccl._src import backend
    cu = backend.runtimes()["cuda"]
    report["stats"] = {k: v for k, v in cu.stats().items() if k.startswith("host_") or k in ("started", "completed", "failed", "launches")}
  except Exception as e:  # noqa: BLE001
    report["stats_error"] = str(e)
  print(json.dumps(report, indent=1))
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(report, fh, indent=1)
  return 0 if exact and ran == args.ops * args.iters else 1


if __name__ == "__main__":
  sys.exit(main())
