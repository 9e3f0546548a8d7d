"""GPU tests of the CUDA backend through the public API (run with `pytest -m gpu tests/gpu`).

The mesh axis spans every GPU JAX sees; on a machine with one GPU the tests
that need a peer (chaos orders, a missing rank, the jax.lax hang) are skipped
and the rest run over a group of one, which lowers without the runtime
(core._trivial): they then check the CUDA lowering of that path.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402


from jax_dfccl.testing import gpus  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(len(gpus()) < 1, reason="needs a GPU")]
needs_peer = pytest.mark.skipif(len(gpus()) < 2, reason="needs >= 2 GPUs")

if len(gpus()) >= 1:
  import jax_dfccl as d
  N = len(gpus())
  MESH = Mesh(np.array(gpus()), ("x",))


def smap(f):
  return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=P("x"), out_specs=P("x"), check_vma=False))


def pair(op, **kw):
  ours = {
      "psum": lambda y: d.psum(y, "x"), "pmax": lambda y: d.pmax(y, "x"), "pmin": lambda y: d.pmin(y, "x"),
      "all_gather": lambda y: d.all_gather(y, "x", tiled=True),
      "psum_scatter": lambda y: d.psum_scatter(y, "x", tiled=True),
      "all_to_all": lambda y: d.all_to_all(y, "x", 0, 0, tiled=True),
      "ppermute": lambda y: d.ppermute(y, "x", [(i, (i + 1) % N) for i in range(N)]),
  }[op]
  ref = {
      "psum": lambda y: jax.lax.psum(y, "x"), "pmax": lambda y: jax.lax.pmax(y, "x"),
      "pmin": lambda y: jax.lax.pmin(y, "x"),
      "all_gather": lambda y: jax.lax.all_gather(y, "x", tiled=True),
      "psum_scatter": lambda y: jax.lax.psum_scatter(y, "x", tiled=True),
      "all_to_all": lambda y: jax.lax.all_to_all(y, "x", 0, 0, tiled=True),
      "ppermute": lambda y: jax.lax.ppermute(y, "x", [(i, (i + 1) % N) for i in range(N)]),
  }[op]
  return smap(lambda v: ours(v[0])[None]), smap(lambda v: ref(v[0])[None])


OPS = ["psum", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute"]
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32]


def data(elems, dtype, seed):
  rng = np.random.default_rng(seed)
  if dtype == jnp.int32:
    return jnp.asarray(rng.integers(-1000, 1000, (N, elems)), dtype)
  return jnp.asarray(rng.standard_normal((N, elems)), dtype)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elems", [1, 4099, 1 << 20])
def test_parity(op, dtype, elems):
  if op in ("psum_scatter", "all_to_all"):
    elems = elems * N
  if elems == 1 << 20 and dtype not in (jnp.bfloat16, jnp.float32):
    pytest.skip("large sizes: bf16/f32 only")
  x = data(elems, dtype, elems + len(op))
  ours, ref = pair(op)
  got, want = np.asarray(ours(x), np.float64), np.asarray(ref(x), np.float64)
  tol = {jnp.bfloat16: 2e-2, jnp.float16: 2e-3}.get(dtype, 1e-6)
  assert got.shape == want.shape
  assert np.isfinite(got).all()
  assert np.max(np.abs(got - want)) <= tol * (np.max(np.abs(want)) + 1e-30)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("path", ["copy_engine", "copy_engine_pull", "daemon"])
@pytest.mark.parametrize("elems", [(1 << 21) + 3, 1 << 22])
def test_large_paths(op, path, elems):
  """The transports of large messages (copy engines pushing / pulling, daemon direct path), odd sizes included."""
  if op in ("psum_scatter", "all_to_all"):
    elems = elems * N
  names = ("copy_engine_min_bytes", "copy_engine_reduce_min_bytes", "copy_engine_push")
  saved = {k: getattr(d.config, k) for k in names}
  d.configure(copy_engine_min_bytes=-1 if path == "daemon" else 0, copy_engine_reduce_min_bytes=0,
              copy_engine_push=path != "copy_engine_pull")
  try:
    before = d.stats()["cuda"]["copy_engine_ops"]
    x = data(elems, jnp.float32, elems + len(op) + len(path))
    ours, ref = pair(op)
    got = np.asarray(ours(x))
    moved = d.stats()["cuda"]["copy_engine_ops"] - before
  finally:
    d.configure(**saved)
  want = np.asarray(ref(x))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
  if op in ("psum", "pmax", "pmin"):
    assert (got == got[:1]).all(), "ranks disagree on an all-reduce"
  reduction = op in ("psum", "pmax", "pmin", "psum_scatter")
  # A group of one never uses the copy engines (nothing to move); reductions do with 2 ranks.
  assert moved == (1 if path != "daemon" and N > 1 and (N == 2 or not reduction) else 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["psum", "pmax", "psum_scatter"])
def test_copy_engine_combine_dtypes(op, dtype):
  """The copy engines' combine kernel for every dtype, on a size with a tail of odd elements."""
  elems = ((1 << 20) + 5) * (N if op == "psum_scatter" else 1)
  names = ("copy_engine_min_bytes", "copy_engine_reduce_min_bytes")
  saved = {k: getattr(d.config, k) for k in names}
  d.configure(copy_engine_min_bytes=0, copy_engine_reduce_min_bytes=0)
  try:
    before = d.stats()["cuda"]["copy_engine_ops"]
    x = data(elems, dtype, elems + len(op))
    ours, ref = pair(op)
    got = np.asarray(ours(x), np.float64)
    moved = d.stats()["cuda"]["copy_engine_ops"] - before
  finally:
    d.configure(**saved)
  want = np.asarray(ref(x), np.float64)
  tol = {jnp.bfloat16: 2e-2, jnp.float16: 2e-3}.get(dtype, 1e-6)
  assert np.max(np.abs(got - want)) <= tol * (np.max(np.abs(want)) + 1e-30)
  assert moved == (1 if N == 2 else 0)


@pytest.mark.parametrize("groups", ["reversed", "singletons"])
@pytest.mark.parametrize("op", ["psum", "pmax", "all_gather", "psum_scatter", "all_to_all"])
def test_axis_index_groups(op, groups):
  """axis_index_groups as jax.lax: one group in reversed rank order, or one group per GPU."""
  g = [list(range(N))[::-1]] if groups == "reversed" else [[i] for i in range(N)]
  fns = {
      "psum": lambda lib, y: lib.psum(y, "x", axis_index_groups=g),
      "pmax": lambda lib, y: lib.pmax(y, "x", axis_index_groups=g),
      "all_gather": lambda lib, y: lib.all_gather(y, "x", tiled=True, axis_index_groups=g),
      "psum_scatter": lambda lib, y: lib.psum_scatter(y, "x", tiled=True, axis_index_groups=g),
      "all_to_all": lambda lib, y: lib.all_to_all(y, "x", 0, 0, tiled=True, axis_index_groups=g),
  }
  x = data(4096 * N, jnp.float32, 11)
  got = smap(lambda v: fns[op](d, v[0])[None])(x)
  want = smap(lambda v: fns[op](jax.lax, v[0])[None])(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.bool_, np.uint16])
@pytest.mark.parametrize("op", ["all_gather", "all_to_all", "ppermute", "psum", "pmax"])
def test_other_dtypes(op, dtype):
  """Dtypes the runtime does not have: bytes for data movement, int32 for small-integer reductions."""
  if op in ("psum", "pmax") and dtype == np.bool_:
    pytest.skip("no bool reductions")
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.integers(0, 2, (N, 4099 * N)).astype(bool) if dtype == np.bool_ else
                  rng.integers(np.iinfo(dtype).min, int(np.iinfo(dtype).max) + 1, (N, 4099 * N)).astype(dtype))
  ours, ref = pair(op)
  got, want = np.asarray(ours(x)), np.asarray(ref(x))
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mib", [1024])
def test_parity_1gib(mib):
  x = jnp.asarray(np.random.default_rng(3).integers(-8, 8, (N, mib * 1024 * 1024 // 2)), jnp.bfloat16)
  ours, ref = pair("psum")
  assert np.array_equal(np.asarray(ours(x)), np.asarray(ref(x)))


@needs_peer
def test_chaos_order():
  """8 collectives started in rank-specific orders, 100 iterations, exact results."""
  from jax_dfccl import testing as T
  ncoll, elems = T.NUM, 4096
  chaos = T.alternating_chaos("x", N, elems, seed=0)
  f = smap(lambda v: chaos(v[0])[None])
  x = jnp.asarray(np.random.default_rng(1).integers(-50, 50, (N, elems)), jnp.float32)
  xs = np.asarray(x, np.float64)
  want = sum((xs.sum(0) if i % 2 == 0 else xs[0]) * (i + 1) for i in range(ncoll))
  for _ in range(100):
    out = f(x)
  for _ in range(3):
    got = np.asarray(f(x))
    assert np.array_equal(got, np.stack([want] * N))
  assert np.array_equal(np.asarray(out), np.stack([want] * N))


@needs_peer
def test_chaos_order_copy_engine():
  """The chaos-order program with 8 MiB collectives (copy engines), exact."""
  from jax_dfccl import testing as T
  ncoll, elems = T.NUM, 1 << 21
  chaos = T.alternating_chaos("x", N, elems, seed=0)
  f = smap(lambda v: chaos(v[0])[None])
  x = jnp.asarray(np.random.default_rng(1).integers(-50, 50, (N, elems)), jnp.float32)
  xs = np.asarray(x, np.float64)
  want = sum((xs.sum(0) if i % 2 == 0 else xs[0]) * (i + 1) for i in range(ncoll))
  saved = {k: getattr(d.config, k) for k in ("copy_engine_min_bytes", "copy_engine_reduce_min_bytes")}
  d.configure(copy_engine_min_bytes=4 << 20, copy_engine_reduce_min_bytes=0)  # every collective, psums too
  try:
    before = d.stats()["cuda"]["copy_engine_ops"]
    for _ in range(10):
      out = f(x)
    got = np.asarray(out)
    moved = d.stats()["cuda"]["copy_engine_ops"] - before
  finally:
    d.configure(**saved)
  assert np.array_equal(got, np.stack([want] * N))
  assert moved == 10 * ncoll


_MIXED_FRESH = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_dfccl as d
from jax_dfccl import testing as T
d.configure(copy_engine_min_bytes=4 << 20, timeout_s=30)
mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
sm = lambda f: jax.jit(jax.shard_map(lambda v: f(v[0])[None], mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                     check_vma=False))
small = sm(lambda y: d.psum(y, "x"))       # a small daemon runs first (the default grid) ...
elems = 1 << 20                              # ... then 4 MiB psums (the large grid) and all_gathers (copy engines)
chaos, ref = sm(T.alternating_chaos("x", 2, elems, seed=1)), sm(T.alternating_reference("x", elems))
x = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (2, elems)), jnp.float32)
np.asarray(small(x[:, :1024]))
want = np.asarray(ref(x))
for _ in range(3):
  assert np.array_equal(np.asarray(chaos(x)), want)
print("OK", d.stats()["cuda"]["copy_engine_ops"])
"""


@needs_peer
def test_mixed_paths_chaos_in_fresh_process():
  """psums on the daemon and all_gathers on the copy engines, started in rank-specific orders, in a
  process whose daemon first ran with the default grid: the larger grid's first launch must not wait
  for the device (local memory is sized when a device is set up), so the program completes, exact."""
  r = subprocess.run([sys.executable, "-c", _MIXED_FRESH], capture_output=True, text=True, timeout=150,
                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                          "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.15"})  # beside this process's share
  assert r.returncode == 0 and "OK" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


def test_fori_loop_reentry():
  def body(v):
    return jax.lax.fori_loop(0, 10, lambda i, y: d.psum(y, "x", key="loop") * 0.5, v[0])[None]
  x = data(1000, jnp.float32, 5)
  want = np.asarray(x, np.float64).sum(0)
  for _ in range(9):
    want = want * N * 0.5
  want = want * 0.5
  got = np.asarray(smap(body)(x))
  np.testing.assert_allclose(got, np.stack([want] * N), rtol=1e-5)


def test_two_programs_in_flight():
  f = smap(lambda v: d.psum(v[0], "x", key="prog_f")[None])
  g = smap(lambda v: d.all_gather(v[0], "x", tiled=True, key="prog_g")[None])
  x = data(4096, jnp.float32, 7)
  a, b = f(x), g(x)  # both dispatched before either is awaited
  a2, b2 = f(x * 2), g(x * 2)
  np.testing.assert_allclose(np.asarray(a2), 2 * np.asarray(a), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(b2), 2 * np.asarray(b), rtol=1e-6)


@needs_peer
def test_timeout_names_missing_rank():
  d.configure(timeout_s=2.0)
  try:
    def body(v):
      y = v[0]
      return jax.lax.cond(jax.lax.axis_index("x") == 0, lambda y: d.psum(y, "x", key="lonely"), lambda y: y, y)[None]
    x = data(256, jnp.float32, 9)
    t0 = time.perf_counter()
    jax.block_until_ready(smap(body)(x))  # rank 0 is released by the watchdog
    assert time.perf_counter() - t0 < 60
    with pytest.raises(Exception, match="lonely"):
      jax.block_until_ready(smap(lambda v: d.psum(v[0], "x", key="after")[None])(x))
    errs = d.stats()["cuda"]["errors"]
    assert any("lonely" in e and "never started" in e for e in errs), errs
  finally:
    d.reset()
    d.configure(timeout_s=300.0)
  x = data(256, jnp.float32, 10)
  got = smap(lambda v: d.psum(v[0], "x", key="recovered")[None])(x)
  np.testing.assert_allclose(np.asarray(got)[0], np.asarray(x, np.float64).sum(0), rtol=1e-5)


def test_idle_daemon_quits_and_memory_is_flat():
  x = data(512, jnp.float32, 11)
  f = smap(lambda v: jax.lax.fori_loop(
      0, 10, lambda i, y: sum(d.psum(y, "x", key=f"k{j}") for j in range(1000)) * (0.5 / 1000), v[0])[None])
  jax.block_until_ready(f(x))
  before = d.stats()["cuda"]["bytes_held"]
  jax.block_until_ready(f(x))  # 10,000 collectives over 1,000 distinct keys
  after = d.stats()["cuda"]
  assert after["bytes_held"] == before
  time.sleep(0.005)
  assert d.stats()["cuda"]["daemons_running"] == 0


@needs_peer
def test_chaos_workload_exact():
  """The shared chaos workload (8 kinds/sizes, rank-specific start and done orders), 100 iterations."""
  from jax_dfccl import testing as T
  xs = T.chaos_inputs(MESH, "x")
  ours = T.chaos_program(MESH, "x", 100)(*xs)
  ref = T.reference_program(MESH, "x", 100)(*xs)
  for (name, *_), a, b in zip(T.collectives("x", N), ours, ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@needs_peer
def test_lax_chaos_program_hangs():
  """The same chaos program with blocking jax.lax collectives deadlocks (subprocess, killed)."""
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  with pytest.raises(subprocess.TimeoutExpired):
    subprocess.run([sys.executable, "-P", "-m", "jax_dfccl.demo", "--lax-chaos-child"], env=env,
                   capture_output=True, timeout=30)
