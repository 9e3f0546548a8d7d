"""Gradients (JVP/transpose rules) and vmap of the collectives, against jax.lax."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from jax_dfccl._src import compat
from conftest import put

CASES = {
    "psum": lambda lib, v: lib.psum(v, "y") * 2.0,
    "all_gather": lambda lib, v: lib.all_gather(v, "x", tiled=True),
    "all_gather_ax1": lambda lib, v: lib.all_gather(v, ("x", "y"), axis=1),
    "psum_scatter": lambda lib, v: lib.psum_scatter(v, "y", tiled=True),
    "psum_scatter_d1": lambda lib, v: lib.psum_scatter(v, "x", scatter_dimension=1, tiled=True),
    "all_to_all": lambda lib, v: lib.all_to_all(v, "y", 0, 1, tiled=True),
    "ppermute": lambda lib, v: lib.ppermute(v, "y", [(0, 1), (1, 2), (2, 3), (3, 0)]),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_grad_matches_lax(mesh24, case, check_vma):
  x = put(jax.random.normal(jax.random.key(1), (16, 8)), mesh24, P("x", "y"))
  w = jax.random.normal(jax.random.key(2), (64, 64))

  def loss(lib):
    def local(v):
      y = CASES[case](lib, v)
      y = y.reshape(-1)
      s = jnp.sum(jnp.sin(y) * w.reshape(-1)[: y.size])
      if check_vma:  # make the local loss varying over every axis before the final psum
        missing = tuple(a for a in ("x", "y") if a not in compat.varying(jax.typeof(s)))
        s = jax.lax.pcast(s, missing, to="varying") if missing else s
      return jax.lax.psum(s, ("x", "y"))
    f = jax.shard_map(local, mesh=mesh24, in_specs=P("x", "y"), out_specs=P(),
                      check_vma=check_vma)
    return jax.jit(jax.grad(f))

  np.testing.assert_allclose(loss(dc)(x), loss(jax.lax)(x), rtol=1e-5, atol=1e-6)


def test_jvp_matches_lax(mesh24):
  x = put(jax.random.normal(jax.random.key(3), (16, 8)), mesh24, P("x", "y"))
  t = put(jax.random.normal(jax.random.key(4), (16, 8)), mesh24, P("x", "y"))
  f = lambda lib: jax.shard_map(lambda v: lib.all_gather(v, "y", tiled=True) ** 2, mesh=mesh24,
                                in_specs=P("x", "y"), out_specs=P("x", "y"))
  (a, da), (b, db) = jax.jvp(f(dc), (x,), (t,)), jax.jvp(f(jax.lax), (x,), (t,))
  np.testing.assert_allclose(a, b, rtol=1e-6)
  np.testing.assert_allclose(da, db, rtol=1e-6)


def test_pmax_jvp(mesh24):
  """d pmax: the tangent of the winning rank (averaged over ties)."""
  x = put(jnp.arange(32.0).reshape(8, 4), mesh24, P("x", "y"))
  t = put(jnp.arange(32.0).reshape(8, 4) * 10, mesh24, P("x", "y"))
  f = jax.shard_map(lambda v: dc.pmax(v, "x"), mesh=mesh24, in_specs=P("x", "y"),
                    out_specs=P(None, "y"))
  y, dy = jax.jvp(f, (x,), (t,))
  xs = np.arange(32.0).reshape(2, 4, 4)
  np.testing.assert_array_equal(y, xs.max(0))
  np.testing.assert_array_equal(dy, xs.max(0) * 10)


@pytest.mark.parametrize("case", list(CASES))
def test_vmap_matches_lax(mesh24, case):
  xb = jax.random.normal(jax.random.key(5), (3, 16, 8))
  xb = put(xb, mesh24, P(None, "x", "y"))

  def f(lib):
    sm = jax.shard_map(lambda v: CASES[case](lib, v), mesh=mesh24, in_specs=P("x", "y"),
                       out_specs=P(("x", "y")), check_vma=False)
    return jax.jit(jax.vmap(sm))
  np.testing.assert_allclose(f(dc)(xb), f(jax.lax)(xb), rtol=1e-6, atol=1e-6)
