"""Collectives inside a partially-manual shard_map (axis_names=...: the other mesh axes
left to XLA's partitioner), compared with jax.lax on a 2x4 mesh, one axis manual."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_dfccl as dc


def _body(name, manual, n, lib, v):
  r = jax.lax.axis_index(manual).astype(v.dtype) + 1  # rank-dependent values
  if name == "psum":
    return lib.psum(v * r, manual)
  if name == "pmax":
    return lib.pmax(v * r, manual)
  if name == "pmean":
    return lib.pmean(v * r, manual)
  if name == "all_gather":
    return lib.all_gather(v, manual, axis=1, tiled=True)
  if name == "psum_scatter":
    return lib.psum_scatter(v * r, manual, scatter_dimension=1, tiled=True)
  if name == "all_to_all":
    return lib.all_to_all(v * r, manual, 1, 0, tiled=True)
  if name == "ppermute":
    return lib.ppermute(v * r, manual, [(i, (i + 1) % n) for i in range(n)])
  raise AssertionError(name)


def _program(mesh, manual, name, lib):
  body = partial(_body, name, manual, mesh.shape[manual], lib)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(manual), out_specs=P(manual),
                               axis_names={manual}))


OPS = ["psum", "pmax", "pmean", "all_gather", "psum_scatter", "all_to_all", "ppermute"]


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("manual", ["x", "y"])
def test_partially_manual_as_lax(mesh24, manual, name):
  # The automatic axis keeps a sharding of its own inside (the input is sharded over both).
  x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh24, P("x", "y")))
  f = _program(mesh24, manual, name, dc)
  assert "dfccl_start" in f.trace(x).lower().as_text()
  got, want = f(x), _program(mesh24, manual, name, jax.lax)(x)
  assert got.shape == want.shape
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_partially_manual_reference_values(mesh24):
  # jax.lax aside: a psum over manual "x" of rows split over "x" is the sum of the two halves.
  xs = np.arange(64.0).reshape(8, 8)
  x = jax.device_put(jnp.asarray(xs), NamedSharding(mesh24, P("x", "y")))
  got = _program(mesh24, "x", "psum", dc)(x)
  want = np.concatenate([xs[:4] + 2 * xs[4:]] * 2)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_partially_manual_grad_as_lax(mesh24):
  x = jax.device_put(jnp.arange(64.0).reshape(8, 8) / 10, NamedSharding(mesh24, P("x", "y")))
  g = {}
  for key, lib in (("lax", jax.lax), ("dfccl", dc)):
    f = jax.shard_map(lambda v, lib=lib: jnp.sin(lib.all_gather(v, "x", tiled=True))[::2] * lib.psum(v, "x"),
                      mesh=mesh24, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})
    g[key] = jax.jit(jax.grad(lambda v, f=f: f(v).sum()))(x)
  np.testing.assert_allclose(g["dfccl"], g["lax"], rtol=1e-6)


def test_start_done_in_partially_manual_region_is_refused(mesh24):
  f = jax.shard_map(lambda v: dc.done(dc.psum_start(v, "x")), mesh=mesh24, in_specs=P("x"),
                    out_specs=P("x"), axis_names={"x"})
  x = jax.device_put(jnp.zeros((8, 8)), NamedSharding(mesh24, P("x", "y")))
  with pytest.raises(NotImplementedError, match="partially-manual"):
    jax.jit(f).trace(x).lower()


def test_vmap_of_shard_map_over_explicit_mesh_as_lax():
  # vmap over a dim sharded on explicit axis "x" leaves "x" automatic inside the shard_map
  # over "y": the nested region keeps that sharding.
  from jax.sharding import AxisType
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2,
                       devices=jax.devices("cpu")[:8])
  with jax.set_mesh(mesh):
    arr = jax.device_put(jnp.arange(32.0).reshape(2, 16), P("x", "y"))
    outs = []
    for lib in (jax.lax, dc):
      f = jax.shard_map(lambda v, lib=lib: lib.psum(v, "y"), in_specs=P("y"), out_specs=P(None))
      outs.append(jax.jit(jax.vmap(f))(arr))
  assert outs[1].sharding == outs[0].sharding
  np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(outs[0]))
  np.testing.assert_array_equal(np.asarray(outs[0]), np.arange(32.0).reshape(2, 4, 4).sum(1))


def test_partially_manual_with_a_size_one_manual_axis():
  # manual {"x", "z"} with "z" of size 1: still partially manual ("y" is automatic).
  from conftest import cpu_mesh
  mesh = cpu_mesh((2, 4, 1), ("x", "y", "z"))
  x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x", "y")))
  outs = []
  for lib in (jax.lax, dc):
    f = jax.shard_map(lambda v, lib=lib: lib.psum(v * (jax.lax.axis_index("x") + 1), "x"), mesh=mesh,
                      in_specs=P("x"), out_specs=P("x"), axis_names={"x", "z"})
    outs.append(np.asarray(jax.jit(f)(x)))
  np.testing.assert_array_equal(outs[1], outs[0])
