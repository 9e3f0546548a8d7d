"""A blocking collective whose rank's input is larger than one collective may carry (a
group spanning hosts: a receive slot's section) runs as several over pieces of every
rank's input (lowering_plans._split_lowering, OpDef.split).  Here on CPU devices with the test
setting ``config.testing.piece_bytes``, which applies the same split on any backend: every
op that splits gives jax.lax's result on the same inputs, with sizes that leave a short
last piece, under start orders that differ per rank; the runtime saw one collective per
piece.  (On GPUs between hosts: tests/gpu/test_gpu_multiprocess.py, the parity case.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import put

N = 8


def _ops(lib):
  return {
      "psum": lambda v: lib.psum(v, "x"),
      "pmax": lambda v: lib.pmax(v, "x"),
      "all_gather": lambda v: lib.all_gather(v, "x"),
      "all_gather_tiled": lambda v: lib.all_gather(v, "x", axis=1, tiled=True),
      "psum_scatter": lambda v: lib.psum_scatter(v, "x", scatter_dimension=0, tiled=True),
      "all_to_all": lambda v: lib.all_to_all(v, "x", 0, 1, tiled=True),
      "ppermute": lambda v: lib.ppermute(v, "x", [(i, (i + 3) % N) for i in range(N)]),
  }


def _smap(f, mesh):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))


@pytest.fixture
def pieces_of_100_bytes():
  old = dc.config.testing.piece_bytes
  dc.config.testing.piece_bytes = 100
  yield 100
  dc.config.testing.piece_bytes = old


@pytest.mark.parametrize("op", list(_ops(jax.lax)))
def test_split_collectives_match_lax(mesh8, pieces_of_100_bytes, op):
  rows = 8  # per rank: 8 x 13 float32 = 416 bytes (5 pieces of at most 100 bytes, the last short)
  x = put(jnp.asarray(np.random.default_rng(3).integers(-50, 50, (N * rows, 13)), jnp.float32), mesh8, P("x"))
  before = dc.stats()["cpu"]["started"]
  got = _smap(_ops(dc)[op], mesh8)(x).block_until_ready()
  started = dc.stats()["cpu"]["started"] - before
  want = _smap(_ops(jax.lax)[op], mesh8)(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert started >= 2 * N, started  # (one collective per piece and rank: split)


def test_pieces_meet_whatever_order_each_rank_starts_them(mesh8, pieces_of_100_bytes):
  """Two split psums started in opposite orders on even and odd ranks: matched by key."""
  def f(v):
    a, b = v, v * 2 + 1
    even = jax.lax.axis_index("x") % 2 == 0
    ra, rb = jax.lax.cond(even, lambda: (dc.psum(a, "x", key="a"), dc.psum(b, "x", key="b")),
                          lambda: tuple(reversed((dc.psum(b, "x", key="b"), dc.psum(a, "x", key="a")))))
    return ra + 10 * rb
  x = put(jnp.arange(N * 40.0).reshape(N, 40), mesh8, P("x"))
  got = _smap(f, mesh8)(x)
  xs = np.arange(N * 40.0).reshape(N, 40)
  want = xs.sum(0) + 10 * (2 * xs + 1).sum(0)
  np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(want, (N, 40)).reshape(N, 40))


def test_gradient_through_a_split_psum(mesh8, pieces_of_100_bytes):
  x = put(jnp.arange(N * 64.0).reshape(N, 64) / 100, mesh8, P("x"))
  def loss(lib):
    return lambda v: jnp.sum(jnp.sin(_smap(lambda u: lib.psum(u * u, "x"), mesh8)(v)))
  np.testing.assert_allclose(np.asarray(jax.grad(loss(dc))(x)), np.asarray(jax.grad(loss(jax.lax))(x)),
                             rtol=1e-6)


def test_small_inputs_stay_one_collective(mesh8, pieces_of_100_bytes):
  x = put(jnp.arange(N * 5.0).reshape(N, 5), mesh8, P("x"))  # 20 bytes per rank
  before = dc.stats()["cpu"]["started"]
  _smap(lambda v: dc.psum(v, "x"), mesh8)(x).block_until_ready()
  assert dc.stats()["cpu"]["started"] - before == N
