"""Per-op device timeline of a chain of blocking 4 KiB psums over a group of one forced
through the GPU runtime: wall time per op, handler calls per executed collective, host time per
call; with --trace the trace records of the last ops (the submit kernel's and the inline kernel's
steps, the stream's done wait, the daemon's start/run/finish), in microseconds.  python tools/device_timeline.py [--trace] [--inline-us US]"""
import os, sys, time, json
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import jax_dfccl as d
from jax_dfccl._src import backend
d.config.runtime_for_groups_of_one = True
TRACE = "--trace" in sys.argv
d.config.trace = TRACE
if "--inline-us" in sys.argv:  # the inline submit kernel's budget (0: the daemon runs every task)
  d.config.submit_inline_us = float(sys.argv[sys.argv.index("--inline-us") + 1])
mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
NOPS = 32
def body(v):
  for i in range(NOPS):
    v = d.psum(v, "x", key=f"t/{i}")
  return v
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
x = jnp.ones(1024, jnp.float32)
y = f(x).block_until_ready()
cu = backend.runtimes()["cuda"]
def calls():
  s = cu.stats(); return s["host_calls"], s["host_start_us"] * s["host_calls"], s["host_streamop_us"] * s["host_calls"]
c0 = calls()
t0 = time.perf_counter()
for it in range(50):
  y = f(y)
y.block_until_ready()
dt = (time.perf_counter() - t0) / 50
c1 = calls()
n = c1[0] - c0[0]
print(f"us/op wall {dt / NOPS * 1e6:.1f}  handler calls/op {n / (50 * NOPS):.2f}  host us/call {(c1[1]-c0[1])/max(n,1):.1f}  launch us/call {(c1[2]-c0[2])/max(n,1):.1f}")
if TRACE:
  # Per op (key t/i of the last execution): the submit kernel's and the stream's events.
  by_op = {}
  for _, key, seq, ev, t in cu.trace_records():
    by_op.setdefault(key, {}).setdefault(seq, {})[ev] = t
  ops = [(lambda s: s[max(s)] if s else {})(by_op.get(f"t/{i}", {})) for i in range(NOPS)]  # the last execution's
  # The inline kernel runs the lane between submit_matched and submit_published (inline_lane ..
  # lane_fenced) and, having completed the task itself, does not wait (no stream_wait/woke).
  legs = [("submit_enter", "submit_matched"), ("submit_matched", "inline_lane"), ("inline_lane", "lane_entered"),
          ("lane_entered", "lane_ready"), ("lane_ready", "lane_polled"), ("lane_polled", "lane_combined"),
          ("lane_combined", "lane_fenced"), ("lane_fenced", "submit_published"),
          ("submit_matched", "submit_published"), ("submit_published", "inline_completed"),
          ("submit_published", "stream_wait"), ("stream_wait", "stream_woke")]
  print("median us per op:", end=" ")
  for a, b in legs:
    v = [o[b] - o[a] for o in ops[2:] if a in o and b in o]
    print(f"{a}->{b} {np.median(v) / 1e3:.2f}" if v else f"{a}->{b} n/a", end="; ")
  # The stream's last event of an op (not the daemon's ingest `start`, which may come later).
  last = lambda o: o.get("stream_woke", o.get("inline_completed"))  # noqa: E731
  gaps = [n["submit_enter"] - last(o) for o, n in zip(ops[2:], ops[3:]) if last(o) and "submit_enter" in n]
  print(f"stream's last event->next submit_enter {np.median(gaps) / 1e3:.2f}" if gaps else "")
  period = [n["submit_enter"] - o["submit_enter"] for o, n in zip(ops[2:], ops[3:])
            if "submit_enter" in o and "submit_enter" in n]
  print(f"submit_enter period {np.median(period) / 1e3:.2f} us")
  for i in (NOPS - 2, NOPS - 1):
    t0 = min(ops[i].values()) if ops[i] else 0
    print(f"t/{i}:", sorted((round((t - t0) / 1e3, 2), ev) for ev, t in ops[i].items()))
s = cu.stats(); print({k: s[k] for k in ("started","preemptions","resumes","steps","launches","relaunches")})
