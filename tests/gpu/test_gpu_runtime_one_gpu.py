"""The CUDA runtime on ONE GPU: groups of one rank forced through the daemon
(config.testing.runtime_for_groups_of_one), so its every path runs on a one-GPU
machine — the LL path (small messages), the direct path (larger ones), every
op of the op table including pbroadcast and ragged_all_to_all — and each test
asserts that the runtime did run (its started counter grew).  The reference
is jax.lax on the same inputs (a group of one: XLA's identity), bit for bit:
a reduction over one rank is a copy, NaN and -0.0 included."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jax_dfccl.testing import gpus  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(len(gpus()) < 1, reason="needs a GPU")]

if len(gpus()) >= 1:
  import jax_dfccl as d
  MESH = Mesh(np.array(gpus()[:1]), ("one",))


def _started() -> int:
  return int(d.stats()["cuda"]["started"])


def _smap(f, n_in=1):
  return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=(P(),) * n_in, out_specs=P(), check_vma=False))


OPS = {
    "psum": lambda lib, v: lib.psum(v, "one"),
    "pmax": lambda lib, v: lib.pmax(v, "one"),
    "pmin": lambda lib, v: lib.pmin(v, "one"),
    "all_gather": lambda lib, v: lib.all_gather(v, "one", tiled=True),
    "psum_scatter": lambda lib, v: lib.psum_scatter(v, "one", tiled=True),
    "all_to_all": lambda lib, v: lib.all_to_all(v, "one", 0, 0, tiled=True),
    "ppermute": lambda lib, v: lib.ppermute(v, "one", [(0, 0)]),
}

SIZES = [4096, 1 << 20, 8 << 20]  # bytes: LL pool, direct path, the daemon's large-block mode


def _x(nbytes, dtype, special=False):
  n = nbytes // np.dtype(dtype).itemsize
  v = np.random.default_rng(nbytes).integers(-100, 100, size=n).astype(np.float64)
  if special and np.issubdtype(np.dtype(dtype), np.floating) or dtype == jnp.bfloat16 and special:
    v[: 8] = [np.nan, -0.0, np.inf, -np.inf, 0.0, -np.nan, 1.5, -2.5]
  return jnp.asarray(v.astype(dtype))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.int32])
def test_every_op_through_the_daemon(op, nbytes, dtype):
  x = _x(nbytes, dtype, special=True)
  want = _smap(lambda v: OPS[op](jax.lax, v))(x)
  with d.configured(runtime_for_groups_of_one=True):
    f = _smap(lambda v: OPS[op](d, v))
    assert "dfccl_collective" in f.lower(x).as_text()
    before = _started()
    got = jax.block_until_ready(f(x))
    assert _started() - before == 1, "the runtime did not run"
  _assert_same(op, got, want)


def _assert_same(op, got, want):
  got, want = np.asarray(got), np.asarray(want)
  if op in ("psum", "pmax", "pmin", "psum_scatter"):
    # Arithmetic (16-bit floats through a float accumulator): equal values, NaN where jax.lax has
    # NaN (its payload may differ), the same sign of every zero.
    g, w = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(np.signbit(g[g == 0]), np.signbit(w[w == 0]))
  else:  # data movement: bit for bit
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_donated_program_replays_without_handlers():
  """A program that donates its input and is fed its own output keeps its buffers, so XLA
  replays its command buffer as recorded: the collectives run on the device (`started` grows
  by their count) while no handler does (`host_calls` stays), and the result is exact."""
  x = _x(4096, jnp.float32)

  def body(v):
    for _ in range(16):
      v = d.psum(v, "one") * -1.0  # (a negation: exact, and XLA keeps it)
    return v
  with d.configured(runtime_for_groups_of_one=True):
    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P(), out_specs=P(), check_vma=False), donate_argnums=0)
    y = f(jnp.array(x))
    for _ in range(3):  # the first executions may still re-capture commands whose buffers moved
      y = f(y)
    jax.block_until_ready(y)
    st0 = d.stats()["cuda"]
    for _ in range(4):
      y = f(y)
    y = np.asarray(jax.block_until_ready(y))
    st1 = d.stats()["cuda"]
  assert st1["started"] - st0["started"] == 64, "the collectives did not all run"
  assert st1["host_calls"] == st0["host_calls"], "a handler ran: XLA re-captured a command"
  np.testing.assert_array_equal(y, np.asarray(x))  # 128 negations


@pytest.mark.parametrize("nbytes", SIZES)
def test_start_done_in_a_loop_through_the_daemon(nbytes):
  x = _x(nbytes, jnp.float32)

  def body(v):
    def step(i, y):
      h1 = d.psum_start(y, "one")
      h2 = d.all_gather_start(y * 2, "one", tiled=True)
      return d.done(h1) + d.done(h2)
    return jax.lax.fori_loop(0, 5, step, v)
  with d.configured(runtime_for_groups_of_one=True):
    before = _started()
    got = jax.block_until_ready(_smap(body)(x))
    assert _started() - before == 10
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x) * 3 ** 5)


@pytest.mark.parametrize("nbytes", SIZES)
def test_pbroadcast_through_the_daemon(nbytes):
  x = _x(nbytes, jnp.bfloat16, special=True)
  with d.configured(runtime_for_groups_of_one=True):
    before = _started()
    got = jax.block_until_ready(_smap(lambda v: d.pbroadcast(v, "one", 0))(x))
    assert _started() - before == 1
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(x).view(np.uint16))


@pytest.mark.parametrize("rows,row_shape,dtype", [(64, (3,), jnp.float32), (4096, (128,), jnp.bfloat16),
                                                  (33, (5,), jnp.int8)])
def test_ragged_all_to_all_through_the_daemon(rows, row_shape, dtype):
  rng = np.random.default_rng(rows)
  operand = jnp.asarray(rng.integers(-100, 100, size=(rows,) + row_shape).astype(dtype))
  output = jnp.asarray(rng.integers(-100, 100, size=(rows + 7,) + row_shape).astype(dtype))
  # two slices to the one rank (k = 2): rows [2, 2+a) -> 5, rows [b, b+c) -> 5+a+1
  a, b = rows // 3, rows // 2
  c = rows - b - 1
  io, ss = jnp.array([2, b], jnp.int32), jnp.array([a, c], jnp.int32)
  oo = jnp.array([5, 5 + a + 1], jnp.int32)
  ref = np.asarray(output).copy()
  ref[5:5 + a] = np.asarray(operand)[2:2 + a]
  ref[6 + a:6 + a + c] = np.asarray(operand)[b:b + c]
  f = lambda op_, out_, i, s, o: d.ragged_all_to_all(op_, out_, i, s, o, s, axis_name="one")
  with d.configured(runtime_for_groups_of_one=True):
    g = _smap(f, n_in=5)
    assert "dfccl_collective" in g.lower(operand, output, io, ss, oo).as_text()
    before = _started()
    got = jax.block_until_ready(g(operand, output, io, ss, oo))
    assert _started() - before == 1
  np.testing.assert_array_equal(np.asarray(got), ref)
  # the plain-HLO path of a group of one agrees
  np.testing.assert_array_equal(np.asarray(_smap(f, n_in=5)(operand, output, io, ss, oo)), ref)
