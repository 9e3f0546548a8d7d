"""Per-op device timeline of a chain of blocking 4 KiB psums over a group of one forced
through the GPU runtime: wall time per op, handler calls per executed collective, host time per
call; with --trace the daemon's trace records (stream_wait, start, run, finish, stream_woke) of the
last ops, in microseconds.  python tools/device_timeline.py [--trace]"""
import os, sys, time, json
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import jax_dfccl as d
from jax_dfccl._src import backend
d.config.runtime_for_groups_of_one = True
TRACE = "--trace" in sys.argv
d.config.trace = TRACE
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
  recs = cu.trace_records()[-5 * 12:]
  t0 = recs[0][4]
  for r in recs:
    print(r[1], r[2], r[3], round((r[4]-t0)/1e3, 2))
s = cu.stats(); print({k: s[k] for k in ("started","preemptions","resumes","steps","launches","relaunches")})
