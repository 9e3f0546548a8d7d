"""Small chaos-order program for compute-sanitizer (memcheck, racecheck)."""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
sys.path.insert(0, os.path.dirname(__file__))
import smoke  # noqa: E402

smoke.check("all_reduce", smoke.jnp.float32, 1000)
smoke.check("all_gather", smoke.jnp.bfloat16, 3000)
smoke.check("reduce_scatter", smoke.jnp.float32, 70000 * smoke.N)
smoke.chaos(iters=3, n_coll=4)
print("CHAOS_SMALL", "FAILED" if smoke.FAIL else "PASSED", flush=True)
sys.exit(1 if smoke.FAIL else 0)
