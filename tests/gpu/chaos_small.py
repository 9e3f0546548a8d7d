"""Small chaos-order program for compute-sanitizer (memcheck, racecheck); --direct: only two direct-path collectives."""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
sys.path.insert(0, os.path.dirname(__file__))
import smoke  # noqa: E402

jnp = smoke.jnp
if "--direct" in sys.argv:  # just the direct path (racecheck is slow): all-reduce and all-gather in place
    smoke.check("all_reduce", jnp.float32, 1 << 18)
    smoke.check("all_gather", jnp.bfloat16, 1 << 18)
    print("CHAOS_SMALL", "FAILED" if smoke.FAIL else "PASSED", smoke.FAIL, flush=True)
    sys.exit(1 if smoke.FAIL else 0)
smoke.check("all_reduce", jnp.float32, 1000)
smoke.check("all_reduce", jnp.bfloat16, 1 << 20)
smoke.check("all_gather", jnp.bfloat16, 1 << 20)
smoke.check("reduce_scatter", jnp.float32, 70000 * smoke.N)
# The direct path (peers' buffers in place) for every op, and a message that is
# not a multiple of 16 bytes (element-wise tails).
smoke.check("all_to_all", jnp.bfloat16, 1 << 20)
smoke.check("ppermute", jnp.float32, 1 << 18, perm=[(i, (i + 1) % smoke.N) for i in range(smoke.N)])
smoke.check("all_reduce", jnp.float32, 1000003)
# The copy-engine path (opt-in: messages of copy_engine_min_bytes and more).
smoke.fd.module().configure({"copy_engine_min_bytes": 4 << 20, "copy_engine_reduce_min_bytes": 4 << 20})
smoke.check("all_reduce", jnp.float32, 3000001)
smoke.check("all_gather", jnp.float32, 1 << 21)
smoke.fd.module().configure({"copy_engine_min_bytes": -1})
smoke.chaos(iters=3, n_coll=4)
smoke.chaos(iters=3, n_coll=4, label="_simple", elems=1025)
print("CHAOS_SMALL", "FAILED" if smoke.FAIL else "PASSED", smoke.FAIL, flush=True)
sys.exit(1 if smoke.FAIL else 0)
