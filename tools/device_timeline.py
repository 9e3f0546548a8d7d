"""Per-op device timeline of a chain of blocking 4 KiB psums over a group of one forced
through the GPU runtime: wall time per op, handler calls per executed collective, host time per
call; with --trace the trace records of the last ops (the submit kernel's and the inline kernel's
steps, the stream's done wait, the daemon's start/run/finish), in microseconds.  python tools/device_timeline.py [--trace] [--inline-us US]

`chain_legs` is also used by the multi-process testbed's bench (tests/gpu/mp_worker.py --trace)."""
import sys
import time

import numpy as np

# The legs of one op, in order: the inline kernel runs the lane between submit_matched and
# submit_published (inline_lane .. lane_fenced) and, having completed the task itself, does
# not wait (no stream_wait/woke).
LEGS = [("submit_enter", "submit_matched"), ("submit_matched", "inline_lane"), ("inline_lane", "lane_entered"),
        ("lane_entered", "lane_ready"), ("lane_ready", "lane_polled"), ("lane_polled", "lane_combined"),
        ("lane_combined", "lane_fenced"), ("lane_fenced", "submit_published"),
        ("submit_matched", "submit_published"), ("submit_published", "inline_completed"),
        ("submit_published", "stream_wait"), ("stream_wait", "stream_woke"),
        # the daemon's (a task the inline kernel does not complete): ingested, first lane step, completed
        ("submit_published", "start"), ("start", "run"), ("run", "finish"), ("finish", "stream_woke")]


def chain_legs(cu, keys):
  """Median µs of each leg over the ops named `keys` (one op per key, their last execution, the
  first two skipped), the gap from an op's last stream event to the next op's submit kernel, and
  the submit-to-submit period; plus the events of the last two ops relative to their first."""
  by_op = {}
  for _, key, seq, ev, t in cu.trace_records():
    by_op.setdefault(key, {}).setdefault(seq, {})[ev] = t
  ops = [(lambda s: s[max(s)] if s else {})(by_op.get(k, {})) for k in keys]
  out = {}
  for a, b in LEGS:
    v = [o[b] - o[a] for o in ops[2:] if a in o and b in o]
    out[f"{a}->{b}"] = float(np.median(v)) / 1e3 if v else None
  last = lambda o: o.get("stream_woke", o.get("inline_completed"))  # noqa: E731  the stream's last event of an op
  gaps = [n["submit_enter"] - last(o) for o, n in zip(ops[2:], ops[3:]) if last(o) and "submit_enter" in n]
  out["last_event->next_submit_enter"] = float(np.median(gaps)) / 1e3 if gaps else None
  period = [n["submit_enter"] - o["submit_enter"] for o, n in zip(ops[2:], ops[3:])
            if "submit_enter" in o and "submit_enter" in n]
  out["submit_enter_period"] = float(np.median(period)) / 1e3 if period else None
  out["last_ops"] = {k: sorted((round((t - min(o.values())) / 1e3, 2), ev) for ev, t in o.items())
                     for k, o in zip(keys[-2:], ops[-2:]) if o}
  return out


def main():
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, PartitionSpec as P

  import jax_dfccl as d
  from jax_dfccl._src import backend
  d.config.testing.runtime_for_groups_of_one = True
  trace = "--trace" in sys.argv
  d.config.trace = trace
  if "--inline-us" in sys.argv:  # the inline submit kernel's budget (0: the daemon runs every task)
    d.config.tuning.submit_inline_us = float(sys.argv[sys.argv.index("--inline-us") + 1])
  mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
  nops = 32

  def body(v):
    for i in range(nops):
      v = d.psum(v, "x", key=f"t/{i}")
    return v
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
  y = f(jnp.ones(1024, jnp.float32)).block_until_ready()
  cu = backend.runtimes()["cuda"]

  def calls():
    s = cu.stats()
    return s["host_calls"], s["host_start_us"] * s["host_calls"], s["host_streamop_us"] * s["host_calls"]
  c0 = calls()
  t0 = time.perf_counter()
  for _ in range(50):
    y = f(y)
  y.block_until_ready()
  dt = (time.perf_counter() - t0) / 50
  c1 = calls()
  n = c1[0] - c0[0]
  print(f"us/op wall {dt / nops * 1e6:.1f}  handler calls/op {n / (50 * nops):.2f}  host us/call "
        f"{(c1[1] - c0[1]) / max(n, 1):.1f}  launch us/call {(c1[2] - c0[2]) / max(n, 1):.1f}")
  if trace:
    legs = chain_legs(cu, [f"t/{i}" for i in range(nops)])
    last_ops = legs.pop("last_ops")
    print("median us per op:", "; ".join(f"{k} {v:.2f}" if v is not None else f"{k} n/a" for k, v in legs.items()))
    for k, evs in last_ops.items():
      print(f"{k}:", evs)
  s = cu.stats()
  print({k: s[k] for k in ("started", "preemptions", "resumes", "steps", "launches", "relaunches")})


if __name__ == "__main__":
  main()
