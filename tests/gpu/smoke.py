"""GPU smoke test of the CUDA backend through its custom calls (no jax_dfccl layer).

Run: python tests/gpu/smoke.py [--quick]   (prints one line per check; exit 1 on failure)
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import ffi_direct as fd  # noqa: E402  (benchmarks/ffi_direct.py: the custom calls without jax_dfccl's layer)

N = len(jax.devices())
MESH = Mesh(np.array(jax.devices()), ("x",))
FAIL = []


def smap(f):
    return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=P("x"), out_specs=P("x"), check_vma=False))


def reference(op, xs, reduce, perm):
    # xs: [N, E] numpy float64
    red = {"sum": np.sum, "max": np.max, "min": np.min}[reduce]
    if op == "all_reduce":
        return np.stack([red(xs, 0)] * N)
    if op == "all_gather":
        return np.stack([xs.reshape(-1)] * N)
    if op == "reduce_scatter":
        b = xs.reshape(N, N, -1)
        return np.stack([red(b[:, r], 0) for r in range(N)])
    if op == "all_to_all":
        b = xs.reshape(N, N, -1)
        return np.stack([b[:, r].reshape(-1) for r in range(N)])
    if op == "ppermute":
        out = np.zeros_like(xs)
        for s, d in perm:
            out[d] = xs[s]
        return out


def check(op, dtype, elems, reduce="sum", perm=None):
    rng = np.random.default_rng(elems + len(op))
    if dtype == jnp.int32:
        xs = rng.integers(-1000, 1000, size=(N, elems))
    else:
        xs = rng.standard_normal((N, elems))
    x = jnp.asarray(xs, dtype)
    f = smap(lambda v: fd.collective(v[0], op, "x", N, reduce=reduce, key=f"{op}{elems}{reduce}",
                                     perm=perm)[None])
    got = np.asarray(jax.block_until_ready(f(x)).astype(jnp.float64))
    ref = reference(op, np.asarray(x.astype(jnp.float64)), reduce, perm)
    got = got.reshape(ref.shape)
    tol = {jnp.bfloat16: 2e-2, jnp.float16: 2e-3}.get(dtype, 1e-6)
    err = np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-30)
    ok = bool(np.isfinite(got).all() and err <= tol)
    print(f"{'ok ' if ok else 'BAD'} {op:15s} {reduce:4s} {jnp.dtype(dtype).name:9s} elems={elems:>9d} rel_err={err:.2e}",
          flush=True)
    if not ok:
        FAIL.append((op, dtype, elems))


def chaos(iters=20, n_coll=8, label="", elems=1024):
    """Rank-dependent start order of n_coll collectives; all dones after; exact results."""
    rng = np.random.default_rng(0)
    orders = [list(rng.permutation(n_coll)) for _ in range(N)]

    def body(v):
        r = jax.lax.axis_index("x")
        def branch(order):
            def run(v):
                hs = {}
                for i in order:
                    op = ["all_reduce", "all_gather"][i % 2]
                    hs[i] = fd.start(v[0] * (i + 1), op, "x", N, key=f"chaos{label}{i}")
                outs = [fd.done(hs[i]) for i in range(n_coll)]
                return jnp.stack([o[: v.shape[1]] for o in outs])[None]
            return run
        return jax.lax.switch(r, [branch(o) for o in orders], v)
    f = smap(body)
    x = jnp.asarray(np.arange(N * elems, dtype=np.float32).reshape(N, elems) % 7)
    xs = np.asarray(x, np.float64)
    ref = np.stack([xs.sum(0) * (i + 1) if i % 2 == 0 else xs[0] * (i + 1) for i in range(n_coll)])
    bad = []
    for it in range(iters):
        got = np.asarray(jax.block_until_ready(f(x)))
        for r in range(N):
            for i in range(n_coll):
                if not np.array_equal(got[r, i], ref[i]):
                    wrong = np.nonzero(got[r, i] != ref[i])[0]
                    like = [j for j in range(n_coll) if np.array_equal(got[r, i], ref[j])]
                    bad.append((it, r, i, len(wrong), int(wrong[0]), float(got[r, i][wrong[0]]),
                                float(ref[i][wrong[0]]), like))
    if bad:
        print(f"BAD chaos{label}: {len({b[0] for b in bad})}/{iters} iterations wrong; "
              "(iter, rank, coll, n_wrong, first, got, want, equals_ref_of):", bad[:8], flush=True)
        FAIL.append(("chaos" + label, len(bad)))
    else:
        print(f"ok  chaos{label} order: {iters} iterations x {n_coll} collectives, exact", flush=True)


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    print("devices:", jax.devices(), flush=True)
    m = fd.module()
    check("all_reduce", jnp.float32, 1000)
    check("all_reduce", jnp.bfloat16, 4096)
    for op in ["all_gather", "reduce_scatter", "all_to_all"]:
        check(op, jnp.float32, 1024 * N)
    check("ppermute", jnp.float32, 999, perm=[(i, (i + 1) % N) for i in range(N)])
    check("ppermute", jnp.float32, 64, perm=[(0, 1)] if N > 1 else [(0, 0)])
    for dt in [jnp.float16, jnp.int32, jnp.float64]:
        check("all_reduce", dt, 12345, "max")
        check("all_reduce", dt, 777, "min")
    check("all_reduce", jnp.float32, 3)
    check("all_gather", jnp.float16, 5)
    for elems in ([1 << 20, 8 << 20] if not quick else [1 << 20]):
        check("all_reduce", jnp.bfloat16, elems)
        check("all_gather", jnp.bfloat16, elems)
        check("reduce_scatter", jnp.float32, elems)
        check("all_to_all", jnp.bfloat16, elems)
    chaos(iters=30 if quick else 60)                 # 4 KiB: LL path (pool 0)
    fd.module().configure({"ll": 0})
    chaos(iters=20, label="_nol")                    # 4 KiB on the simple path
    fd.module().configure({"ll": 1})
    chaos(iters=30, label="_simple", elems=1025)     # 4100 B: simple path (pool 1)
    chaos(iters=10, label="_big", elems=1 << 18)     # 1 MiB: simple path, 15 lanes
    print("stats:", m.stats(), flush=True)
    print("trace records:", len(m.trace_records()), flush=True)
    time.sleep(0.01)
    print("daemons running after 10 ms idle:", m.stats()["daemons_running"], flush=True)
    print("SMOKE", "FAILED" if FAIL else "PASSED", FAIL, flush=True)
    sys.exit(1 if FAIL else 0)
