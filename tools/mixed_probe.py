"""The chaos-order workload with mixed paths: psums on the daemon, all_gathers on
the copy engines (4 MiB each by default), started in rank-specific orders.
Checks every iteration against jax.lax in consistent order and prints
``jax_dfccl.pending()`` from a second thread while an iteration is slow, so a
stall shows which collective waits for what.

  python tools/mixed_probe.py [--bytes 4194304] [--iters 5] [--ce-min-bytes 4194304]
"""
import argparse
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_dfccl as dc
from jax_dfccl import testing as T


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--bytes", type=int, default=4 << 20)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--ce-min-bytes", type=int, default=4 << 20, help="copy_engine_min_bytes (-1: daemon only)")
  ap.add_argument("--timeout-s", type=float, default=20.0)
  ap.add_argument("--report-every", type=float, default=5.0)
  a = ap.parse_args()
  dc.configure(copy_engine_min_bytes=a.ce_min_bytes, timeout_s=a.timeout_s)
  devs = jax.devices()[:2]
  n = len(devs)
  mesh = Mesh(np.array(devs), ("x",))
  elems = a.bytes // 4

  def smap(body):
    return jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))

  ours = smap(T.alternating_chaos("x", n, elems, seed=1))
  ref = smap(T.alternating_reference("x", elems))
  x = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(-3, 4, (n, elems)), jnp.float32),
                     NamedSharding(mesh, P("x")))
  want = np.asarray(ref(x))
  state = {"t0": None, "it": -1}
  stop = threading.Event()

  def reporter():
    while not stop.wait(0.5):
      t0 = state["t0"]
      if t0 is not None and time.perf_counter() - t0 > a.report_every:
        print(f"--- iteration {state['it']} running for {time.perf_counter() - t0:.1f} s; jax_dfccl.pending():\n"
              + dc.pending(), flush=True)
        state["t0"] = time.perf_counter()

  threading.Thread(target=reporter, daemon=True).start()
  for it in range(a.iters):
    state["it"], state["t0"] = it, time.perf_counter()
    t = time.perf_counter()
    try:
      got = np.asarray(jax.block_until_ready(ours(x)))
    except Exception as e:  # noqa: BLE001 - report and stop
      print(f"iteration {it}: error after {time.perf_counter() - t:.1f} s: {str(e)[:800]}", flush=True)
      break
    state["t0"] = None
    print(f"iteration {it}: {1e3 * (time.perf_counter() - t):.2f} ms, exact: {np.array_equal(got, want)}", flush=True)
  stop.set()
  print("stats:", {k: v for k, v in dc.stats().get("cuda", {}).items() if k != "errors"}, flush=True)


if __name__ == "__main__":
  main()
