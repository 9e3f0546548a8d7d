"""axis_index_groups: every rank of an axis split into groups, as jax.lax (results compared on
the same inputs), including non-contiguous groups, multi-axis names, pytrees and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import put

N = 8
GROUPS = {
    "halves": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "strided": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "pairs": [[1, 0], [3, 2], [5, 4], [7, 6]],  # order inside a group sets the rank order
    "singletons": [[i] for i in range(8)],
}


def _ops(lib, g):
  return {
      "pmax": lambda v: lib.pmax(v, "x", axis_index_groups=g),
      "pmin": lambda v: lib.pmin(v, "x", axis_index_groups=g),
      "all_gather": lambda v: lib.all_gather(v, "x", axis_index_groups=g),
      "all_gather_tiled": lambda v: lib.all_gather(v, "x", axis=1, tiled=True, axis_index_groups=g),
      "psum_scatter": lambda v: lib.psum_scatter(v, "x", scatter_dimension=0, tiled=True, axis_index_groups=g),
      "all_to_all": lambda v: lib.all_to_all(v, "x", 0, 1, tiled=True, axis_index_groups=g),
      "psum": lambda v: lib.psum(v, "x", axis_index_groups=g),
  }


def _smap(f, mesh, spec=P("x")):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


@pytest.mark.parametrize("gname", list(GROUPS))
@pytest.mark.parametrize("op", list(_ops(jax.lax, None)))
def test_matches_lax(mesh8, gname, op):
  g = GROUPS[gname]
  x = put(jnp.asarray(np.random.default_rng(1).integers(-50, 50, (N * 8, 6)), jnp.float32), mesh8, P("x"))
  got = _smap(_ops(dc, g)[op], mesh8)(x)
  want = _smap(_ops(jax.lax, g)[op], mesh8)(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_multi_axis_name(mesh24):
  """Groups over the flattened ("x", "y") index (8 ranks of a 2x4 mesh)."""
  g = GROUPS["strided"]
  spec = P(("x", "y"))
  x = put(jnp.arange(N * 3.0).reshape(N, 3), mesh24, spec)
  got = _smap(lambda v: dc.all_gather(v, ("x", "y"), axis_index_groups=g, tiled=True), mesh24, spec)(x)
  want = _smap(lambda v: jax.lax.all_gather(v, ("x", "y"), axis_index_groups=g, tiled=True), mesh24, spec)(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gradient_of_grouped_all_gather(mesh8):
  """The transpose keeps the groups: grad of sum(w * all_gather(x)) is psum_scatter within groups."""
  g = GROUPS["strided"]
  x = put(jnp.arange(N * 2.0).reshape(N, 2), mesh8, P("x"))
  w = jnp.arange(4 * 2.0).reshape(4, 2) + 1

  def loss(lib):
    f = _smap(lambda v: (lib.all_gather(v, "x", axis_index_groups=g, tiled=True) * w).sum(keepdims=True)[0],
              mesh8)
    return lambda v: f(v).sum()

  np.testing.assert_allclose(np.asarray(jax.grad(loss(dc))(x)), np.asarray(jax.grad(loss(jax.lax))(x)))


def test_start_done_form(mesh8):
  g = GROUPS["halves"]
  x = put(jnp.arange(N * 4.0).reshape(N, 4), mesh8, P("x"))
  got = _smap(lambda v: dc.done(dc.pmax_start(v, "x", axis_index_groups=g)), mesh8)(x)
  want = _smap(lambda v: jax.lax.pmax(v, "x", axis_index_groups=g), mesh8)(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("bad,err", [
    ([[0, 1, 2, 3], [4, 5, 6]], ValueError),        # index 7 missing
    ([[0, 1, 2, 3], [3, 4, 5, 6, 7]], ValueError),  # index 3 twice
    ([[0, 1], [2, 3, 4, 5, 6, 7]], NotImplementedError),  # unequal sizes
])
def test_bad_groups_fail_at_trace_time(mesh8, bad, err):
  f = _smap(lambda v: dc.pmax(v, "x", axis_index_groups=bad), mesh8)
  with pytest.raises(err, match="axis_index_groups"):
    f.trace(put(jnp.ones(N), mesh8, P("x")))


def test_psum_groups_with_check_vma_refused_like_lax(mesh8):
  f = jax.jit(jax.shard_map(lambda v: dc.psum(v, "x", axis_index_groups=GROUPS["halves"]), mesh=mesh8,
                            in_specs=P("x"), out_specs=P("x")))
  with pytest.raises(NotImplementedError, match="check_vma"):
    f.trace(put(jnp.ones(N), mesh8, P("x")))
