"""One process of the NVSHMEM transport check (tests/gpu/test_nvshmem_transport.py),
run by tools/mps_testbed.sh: jax.distributed, NVSHMEM's set-up through its key-value
store (jax_dfccl/_src/nvshmem.py), then protocol C over NVSHMEM and over direct stores
on every process at once.  Prints one line ``RESULT {json}``.

    tools/mps_testbed.sh -n 2 -- python3 tests/gpu/nvshmem_worker.py [--blocks 40] [--pingpong 2000]

NVSHMEM's environment for one host comes from the testbed (tools/mps_testbed.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.1")

import jax  # noqa: E402


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--blocks", type=int, default=40)
  ap.add_argument("--msg-bytes", type=int, default=64)
  ap.add_argument("--slots", type=int, default=3)
  ap.add_argument("--mismatch-every", type=int, default=5, help="keys divisible by it differ on the last process")
  ap.add_argument("--pingpong", type=int, default=2000)
  ap.add_argument("--seed", type=int, default=1)
  ap.add_argument("--ranks-per-host", type=int, default=0, help="consecutive processes form a simulated host")
  ap.add_argument("--delay-us", type=float, default=0.0, help="each put to another simulated host waits this long")
  args = ap.parse_args()
  jax.distributed.initialize(os.environ["DFCCL_TESTBED_COORD"], int(os.environ["DFCCL_TESTBED_NPROC"]),
                             int(os.environ["DFCCL_TESTBED_RANK"]))
  from jax_dfccl._src import nvshmem as nv
  out = {"rank": jax.process_index(), "ranks": jax.process_count()}
  ok, why = nv.available()
  if not ok:
    out.update(ok=False, unavailable=why)
    print("RESULT " + json.dumps(out), flush=True)
    return 2
  t0 = time.perf_counter()
  out["init_status"] = nv.initialize(timeout_s=60)
  out["init_s"] = round(time.perf_counter() - t0, 3)
  out["nvshmem"] = nv.load().loaded_version()
  runs = nv.check_transport(blocks=args.blocks, msg_bytes=args.msg_bytes, slots=args.slots, pingpong=args.pingpong,
                            mismatch_every=args.mismatch_every, seed=args.seed, ranks_per_host=args.ranks_per_host,
                            delay_us=args.delay_us)
  out["ranks_per_host"], out["delay_us"] = args.ranks_per_host, args.delay_us
  total = args.blocks * 8
  mismatches = total // args.mismatch_every if args.mismatch_every > 0 and jax.process_count() > 1 else 0  # keys 1..total
  out["expected"] = {"ok": total - mismatches, "failed_as_expected": mismatches}
  out["runs"] = []
  good = True
  for r in runs:
    rt = r.pop("round_trip_us")
    if rt:
      q = statistics.quantiles(rt, n=10)
      r["round_trip_us"] = {"median": round(statistics.median(rt), 3), "p10": round(q[0], 3), "p90": round(q[-1], 3),
                            "n": len(rt)}
    r["instances_per_s"] = round(total / r["seconds"], 1) if r["seconds"] else None
    out["runs"].append(r)
    if not r["skipped"]:
      good &= (r["wrong"] == 0 and r["ok"] == total - mismatches and r["failed_as_expected"] == mismatches
               and r["cap_refused"])
  good &= any(r["transport"] == "nvshmem" and not r["skipped"] for r in runs)
  out["ok"] = bool(good)
  nv.finalize()
  print("RESULT " + json.dumps(out), flush=True)
  return 0 if good else 1


if __name__ == "__main__":
  raise SystemExit(main())
