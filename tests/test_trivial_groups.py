"""Collectives over groups of one rank (a mesh axis of size 1, singleton axis_index_groups):
the same results as jax.lax on the same inputs, blocking and start/done, in loops and under
grad, and without the runtime (nothing started there; no custom call in the program)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import cpu_mesh, put


def _ops(lib):
  return {
      "psum": lambda v: lib.psum(v, "one"),
      "pmax": lambda v: lib.pmax(v, "one"),
      "pmin": lambda v: lib.pmin(v, "one"),
      "pmean": lambda v: lib.pmean(v, "one"),
      "all_gather": lambda v: lib.all_gather(v, "one"),
      "all_gather_tiled": lambda v: lib.all_gather(v, "one", axis=1, tiled=True),
      "psum_scatter": lambda v: lib.psum_scatter(v, "one", scatter_dimension=1, tiled=True),
      "psum_scatter_untiled": lambda v: lib.psum_scatter(v[:, :1], "one", scatter_dimension=1),
      "all_to_all": lambda v: lib.all_to_all(v, "one", 0, 1, tiled=True),
      "ppermute_self": lambda v: lib.ppermute(v, "one", [(0, 0)]),
      "ppermute_none": lambda v: lib.ppermute(v, "one", []),
      "pytree": lambda v: lib.psum({"a": v, "b": (v[:1] * 2, v.astype(jnp.int32))}, "one"),
  }


@pytest.fixture(scope="module")
def mesh41():
  return cpu_mesh((4, 1), ("x", "one"))


def _smap(f, mesh):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))


def _x(seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((8, 6)), jnp.float32)


@pytest.mark.parametrize("op", list(_ops(jax.lax)))
def test_axis_of_size_one_matches_lax(mesh41, op):
  x = put(_x(), mesh41, P("x"))
  started = dc.stats()["cpu"]["started"]
  f = _smap(_ops(dc)[op], mesh41)
  got, want = f(x), _smap(_ops(jax.lax)[op], mesh41)(x)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
  assert dc.stats()["cpu"]["started"] == started, "a group of one reached the runtime"
  assert "dfccl_" not in f.lower(x).as_text(), "custom call emitted for a group of one"


def test_start_done_and_loops(mesh41):
  x = put(_x(1), mesh41, P("x"))

  def body(v):
    def step(i, y):
      h1 = dc.psum_start(y, "one")
      h2 = dc.all_gather_start(y, "one", axis=0, tiled=True)
      return dc.done(h2) * 0.5 + dc.done(h1) * 0.25
    return jax.lax.fori_loop(0, 5, step, v)

  def ref(v):
    return jax.lax.fori_loop(0, 5, lambda i, y: jax.lax.all_gather(y, "one", axis=0, tiled=True) * 0.5
                             + jax.lax.psum(y, "one") * 0.25, v)
  np.testing.assert_allclose(np.asarray(_smap(body, mesh41)(x)), np.asarray(_smap(ref, mesh41)(x)), rtol=1e-6)


def test_grad_matches_lax(mesh41):
  x = put(_x(2), mesh41, P("x"))

  def loss(lib, v):
    y = jax.shard_map(lambda u: lib.psum_scatter(lib.all_gather(u * u, "one", axis=1, tiled=True), "one",
                                                 scatter_dimension=1, tiled=True),
                      mesh=mesh41, in_specs=P("x"), out_specs=P("x"), check_vma=False)(v)
    return jnp.sum(jnp.sin(y))
  np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(lambda v: loss(dc, v)))(x)),
                             np.asarray(jax.jit(jax.grad(lambda v: loss(jax.lax, v)))(x)), rtol=1e-6)


def test_singleton_index_groups_skip_the_runtime(mesh8):
  x = put(_x(3), mesh8, P("x"))
  g = [[i] for i in range(8)]
  f = jax.jit(jax.shard_map(lambda v: dc.psum(v, "x", axis_index_groups=g), mesh=mesh8, in_specs=P("x"),
                            out_specs=P("x"), check_vma=False))
  started = dc.stats()["cpu"]["started"]
  np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))
  assert dc.stats()["cpu"]["started"] == started
  # A real group next to it still goes through the runtime.
  h = jax.jit(jax.shard_map(lambda v: dc.psum(v, "x", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]),
                            mesh=mesh8, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  want = np.asarray(x).reshape(2, 4, 1, 6).sum(1, keepdims=True).repeat(4, 1).reshape(8, 6)
  np.testing.assert_allclose(np.asarray(h(x)), want, rtol=1e-6)
  assert dc.stats()["cpu"]["started"] > started


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_psum"])
def test_overlap_ops_with_tensor_parallelism_of_one(mesh41, op):
  """The GEMM + communication ops over an axis of size 1: x @ w, nothing through the runtime."""
  rng = np.random.default_rng(4)
  x = put(jnp.asarray(rng.standard_normal((16, 32)), jnp.float32), mesh41, P("x"))
  w = jnp.asarray(rng.standard_normal((32, 24)), jnp.float32)
  f = jax.jit(jax.shard_map(lambda a, b: getattr(dc, op)(a, b, "one"), mesh=mesh41, in_specs=(P("x"), P()),
                            out_specs=P("x"), check_vma=False))
  started = dc.stats()["cpu"]["started"]
  np.testing.assert_allclose(np.asarray(f(x, w)), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)
  assert dc.stats()["cpu"]["started"] == started
  assert "dfccl_" not in f.lower(x, w).as_text()


@pytest.mark.parametrize("op", list(_ops(jax.lax)))
def test_forced_through_runtime(mesh41, op):
  """config.testing.runtime_for_groups_of_one: the same results as jax.lax, through the runtime."""
  x = put(_x(2), mesh41, P("x"))
  with dc.configured(runtime_for_groups_of_one=True):
    started = dc.stats()["cpu"]["started"]
    f = _smap(_ops(dc)[op], mesh41)
    assert "dfccl_start" in f.lower(x).as_text() or op == "ppermute_none"
    got = f(x)
    jax.block_until_ready(got)
    ran = dc.stats()["cpu"]["started"] - started
  want = _smap(_ops(jax.lax)[op], mesh41)(x)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
  assert ran >= 4 or op == "ppermute_none", f"{op}: the runtime ran {ran} collectives"


def test_new_ops_forced_through_runtime(mesh41):
  x = put(_x(3), mesh41, P("x"))
  rows = jnp.arange(8 * 3, dtype=jnp.int32).reshape(8, 3)

  def f(v, r):
    b = dc.pbroadcast(v, "one", 0)
    out = jnp.full((5, 6), -1.0)
    g = dc.ragged_all_to_all(v, out, r[0, :1], r[0, 1:2] % 3, r[0, 2:3] % 2, r[0, 1:2] % 3, axis_name="one")
    return b, g[None]
  sm = jax.jit(jax.shard_map(f, mesh=mesh41, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")),
                             check_vma=False))
  r = put(jnp.asarray(np.array([[0, 2, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [1, 2, 0, 0, 0, 0],
                                [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
                               np.int32))[:, :3], mesh41, P("x"))
  want = sm(x, r)
  with dc.configured(runtime_for_groups_of_one=True):
    started = dc.stats()["cpu"]["started"]
    sm2 = jax.jit(jax.shard_map(f, mesh=mesh41, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")),
                                check_vma=False))
    got = jax.block_until_ready(sm2(x, r))
    assert dc.stats()["cpu"]["started"] - started == 8
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  # and the plain-HLO path equals numpy
  xv, rv = np.asarray(x).reshape(4, 2, 6), np.asarray(r).reshape(4, 2, 3)
  for d in range(4):
    ref = np.full((5, 6), -1.0, np.float32)
    io, ss, oo = rv[d, 0, 0], rv[d, 0, 1] % 3, rv[d, 0, 2] % 2
    ref[oo:oo + ss] = xv[d][io:io + ss]
    np.testing.assert_array_equal(np.asarray(want[1])[d], ref)
