"""``python -m jax_dfccl.demo``: chaos-order collectives, jax_dfccl vs jax.lax.

Every rank starts eight collectives in its own order and waits for them in
another.  On GPUs this deadlocks jax.lax (NCCL matches collectives by issue
order; shown in a subprocess killed after a timeout); jax_dfccl matches them by
key and sequence number and completes with exact results.  Without GPUs it
runs on 8 CPU devices.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

ITERS = 20
LAX_TIMEOUT_S = 30


def _mesh():
  import jax
  import numpy as np
  from jax.sharding import Mesh
  try:
    devs = jax.devices("gpu")
  except RuntimeError:
    devs = []
  if len(devs) < 2:
    devs = jax.devices("cpu")[:8]
  return Mesh(np.array(devs), ("x",)), devs[0].platform


def _time(f, xs, reps=3):
  import jax
  out = jax.block_until_ready(f(*xs))  # compile + warm up
  t = time.perf_counter()
  for _ in range(reps):
    out = jax.block_until_ready(f(*xs))
  return out, (time.perf_counter() - t) / reps / ITERS


def _lax_chaos_child():
  """Runs the chaos program with jax.lax collectives; prints 'exact' or 'wrong'."""
  import numpy as np
  from jax_dfccl import testing as T
  mesh, _ = _mesh()
  xs = T.chaos_inputs(mesh, "x")
  out = T.chaos_program(mesh, "x", ITERS, lib="lax")(*xs)
  ref = T.reference_program(mesh, "x", ITERS)(*xs)
  ok = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(out, ref))
  print("RESULT", "exact" if ok else "WRONG")


def main():
  import numpy as np
  from jax_dfccl import testing as T

  mesh, platform = _mesh()
  n = mesh.shape["x"]
  xs = T.chaos_inputs(mesh, "x")
  ref, t_ref = _time(T.reference_program(mesh, "x", ITERS), xs)
  ours, t_ours = _time(T.chaos_program(mesh, "x", ITERS), xs)
  exact = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(ours, ref))

  try:
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # the parent holds memory
    # -P: import the installed package, not a source checkout in the working directory.
    p = subprocess.run([sys.executable, "-P", "-m", "jax_dfccl.demo", "--lax-chaos-child"], env=env,
                       capture_output=True, text=True, timeout=LAX_TIMEOUT_S)
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
    lax_chaos = line[0].split()[1] if line else f"error (exit {p.returncode})"
  except subprocess.TimeoutExpired:
    lax_chaos = f"HANG (killed after {LAX_TIMEOUT_S} s)"

  rows = [
      ("rank-specific order", "jax_dfccl (start/done, keyed)", "exact" if exact else "WRONG",
       f"{t_ours * 1e3:.3f} ms"),
      ("rank-specific order", "jax.lax (blocking)", lax_chaos, "-"),
      ("same order on every rank", "jax.lax (blocking)", "reference", f"{t_ref * 1e3:.3f} ms"),
  ]
  print(f"\nchaos-order workload: {T.NUM} collectives x {ITERS} iterations on {n} "
        f"{platform.upper()} devices\n")
  w = [max(len(r[i]) for r in rows + [("program", "collectives", "result", "time/iteration")])
       for i in range(4)]
  hdr = ("program", "collectives", "result", "time/iteration")
  print("  ".join(h.ljust(w[i]) for i, h in enumerate(hdr)))
  print("  ".join("-" * w[i] for i in range(4)))
  for r in rows:
    print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)))
  print("\nresult: the outputs against the reference row's, bit for bit ('exact'), or HANG/WRONG; jax.lax in\n"
        "rank-specific order runs in a child process with a timeout, so it has no time (it may hang).\n")
  return 0 if exact else 1


if __name__ == "__main__":
  if "--lax-chaos-child" in sys.argv:
    _lax_chaos_child()
  else:
    sys.exit(main())
