"""jax_dfccl's collectives across processes beside NVSHMEM's own, in the same processes of one run.

One process per rank (``tools/mps_testbed.sh`` on one GPU under MPS, or one per GPU). In each:
``jax.distributed``, ``jax_dfccl.initialize()``, NVSHMEM's set-up through the job's key-value
store (``jax_dfccl._src.nvshmem.initialize``), then per op and size (bytes of each rank's input):

- ours: a donated ``fori_loop`` of ``--iters`` (100) dependent calls (psum: ``psum(y) / n``;
  all_gather: the gathered array's first block, a local slice copy; all_to_all: shape-preserving),
  per-call median of 5 rounds of 4 executions (``benchmarks.common.donated_time``); one call checked
  against numpy first;
- NVSHMEM: ``nvshmemx_float_sum_reduce_on_stream`` / ``fcollect`` / ``alltoall`` on
  ``NVSHMEM_TEAM_WORLD``, ``--iters`` calls back to back between CUDA events, median of 5,
  checked once against the exact reference (``jax_dfccl._src.nvshmem.native_collective``).

Process 0 prints ``RESULT {json}`` (and writes it to ``--out`` when given)::

    tools/mps_testbed.sh -n 2 -- python3 benchmarks/nvshmem_peer.py --sizes 4K,1M,64M --out peer.json

Several processes on one GPU share its SMs: from 4 MiB per rank each daemon runs up to
``large_max_blocks`` (64) blocks, so 4 processes need ``--config large_max_blocks=32`` (4 x 64 blocks
do not fit 132 SMs at once; a daemon whose lanes cannot all run stalls until its stall limit,
``stall_quit_us``, and is relaunched: ~100 ms per collective, measured on an H100).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# (NVSHMEM's environment for one host, a 768M heap included: tools/mps_testbed.sh)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.1")
# (the loop bodies have two HLO instructions: XLA keeps such bodies in its command buffers only
# from a graph size of 1, else their handlers run every iteration)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false"
                           " --xla_gpu_graph_min_graph_size=1")

import jax  # noqa: E402

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # benchmarks.common

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s: str) -> int:
  return int(s[:-1]) * UNITS[s[-1]] if s[-1] in UNITS else int(s)


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="bytes of each rank's input")
  ap.add_argument("--ops", default="psum,all_gather,all_to_all")
  ap.add_argument("--iters", type=int, default=100, help="dependent calls per timed loop")
  ap.add_argument("--config", default=None, help="jax_dfccl.config entries, e.g. large_max_blocks=32")
  ap.add_argument("--out", default=None, help="process 0 writes the result here")
  args = ap.parse_args()
  jax.distributed.initialize(os.environ["DFCCL_TESTBED_COORD"], int(os.environ["DFCCL_TESTBED_NPROC"]),
                             int(os.environ["DFCCL_TESTBED_RANK"]))
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import jax_dfccl as d
  from benchmarks.common import donated_time
  from jax_dfccl._src import distributed as dist, nvshmem as nv

  if args.config:  # before initialize(), which reads cross_host_transport (e.g. processes_per_host=1,
    from benchmarks.common import parse_config  # cross_host_transport=nvshmem: ours over NVSHMEM; or several
    d.configure(**parse_config(args.config))    # processes on one GPU: large_max_blocks=32)
  d.initialize()
  rank, n = jax.process_index(), jax.process_count()
  out = {"ranks": n, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "iters": args.iters, "config": args.config,
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv), "rows": []}
  ok, why = nv.available()
  if not ok:
    print("RESULT " + json.dumps({**out, "ok": False, "unavailable": why}), flush=True)
    return 2
  out["nvshmem_init"] = nv.initialize(timeout_s=60)
  out["nvshmem"] = nv.load().loaded_version()
  mesh = Mesh(np.array(jax.devices()), ("x",))

  def smap(f, donate=False):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False),
                   donate_argnums=(0,) if donate else ())

  bodies = {
      "psum": lambda y, k: d.psum(y, "x", key=k) * (1.0 / n),
      "all_gather": lambda y, k: d.all_gather(y, "x", axis=1, tiled=True, key=k)[:, : y.shape[1]],
      "all_to_all": lambda y, k: d.all_to_all(y, "x", 1, 1, tiled=True, key=k),
  }
  good = True
  for op in args.ops.split(","):
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    native = {r["bytes"]: r for r in nv.native_collective(op, sizes, iters=args.iters, reps=5)}
    for nbytes in sizes:
      el = nbytes // 4
      xs = np.stack([(np.arange(el) % 13 + 16 * (r + 1)).astype(np.float32) for r in range(n)])
      xa = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, P("x")), lambda idx, xs=xs: xs[idx])
      key = f"peer/{op}/{nbytes}"
      one = np.asarray(smap(lambda v, key=key: bodies[op](v, key))(xa).addressable_shards[0].data)[0]
      if op == "psum":
        want = xs.sum(0) / n
      elif op == "all_gather":
        want = xs[0]
      else:
        per = el // n
        want = np.concatenate([xs[q, rank * per:(rank + 1) * per] for q in range(n)])
      exact = bool(np.array_equal(one, want.astype(np.float32)))
      loop = smap(lambda v, key=key: jax.lax.fori_loop(0, args.iters, lambda i, y: bodies[op](y, key), v), donate=True)
      ours = donated_time(loop, xa, reps=5, depth=4) / args.iters * 1e6
      nat = native[nbytes]
      row = {"op": op, "bytes": nbytes, "ours_us": round(ours, 2), "ours_exact": exact,
             "nvshmem_us": round(statistics.median(nat["us"]), 2), "nvshmem_us_all": [round(u, 2) for u in nat["us"]],
             "nvshmem_exact": nat["exact"]}
      row["ours_over_nvshmem"] = round(row["ours_us"] / row["nvshmem_us"], 3)
      good &= exact and nat["exact"]
      out["rows"].append(row)
      print("ROW", json.dumps(row), flush=True)
  out["ok"] = bool(good)
  out["engine"] = dist._state.get("engine")  # the daemon's: "nvshmem" (ours over NVSHMEM) or "stores"
  if out["engine"] != "nvshmem":  # (the daemon over NVSHMEM holds the job until the process exits)
    nv.finalize()
  if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
    if args.out:
      with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
  return 0 if good else 1


if __name__ == "__main__":
  raise SystemExit(main())
