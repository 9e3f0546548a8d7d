"""Parity of every collective with jax.lax on the CPU backend (8 devices)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import cpu_mesh, put

DTYPES = [np.float32, jnp.bfloat16, np.float16, np.float64, np.int32]
# (mesh shape, mesh axis names, the collective's axis_name)
MESHES = [((8,), ("x",), "x"), ((2, 4), ("x", "y"), "y"), ((2, 4), ("x", "y"), "x"),
          ((2, 4), ("x", "y"), ("x", "y")), ((2, 4), ("x", "y"), ("y", "x"))]


def _rand(shape, dtype, seed=0):
  # Small integers: every summation order is exact, so results must be equal.
  x = np.random.default_rng(seed).integers(-4, 5, size=shape)
  return jnp.asarray(x, dtype=dtype)


def _ops(lib, ax, n):
  """Every op (and variant) of `lib` (jax.lax or jax_dfccl) on one local block."""
  perm = [(i, (i + 3) % n) for i in range(n)]
  if n > 2:
    perm = perm[:-1]  # one rank receives nothing -> zeros
  return {
      "psum": lambda x: lib.psum(x, ax),
      "pmax": lambda x: lib.pmax(x, ax),
      "pmin": lambda x: lib.pmin(x, ax),
      "all_gather": lambda x: lib.all_gather(x, ax),
      "all_gather_ax1": lambda x: lib.all_gather(x, ax, axis=1),
      "all_gather_tiled": lambda x: lib.all_gather(x, ax, tiled=True),
      "all_gather_tiled_ax1": lambda x: lib.all_gather(x, ax, axis=1, tiled=True),
      "psum_scatter_tiled": lambda x: lib.psum_scatter(x, ax, tiled=True),
      "psum_scatter_tiled_d1": lambda x: lib.psum_scatter(x, ax, scatter_dimension=1, tiled=True),
      "psum_scatter": lambda x: lib.psum_scatter(x.reshape(n, -1), ax),
      "all_to_all_tiled": lambda x: lib.all_to_all(x, ax, 0, 1, tiled=True),
      "all_to_all": lambda x: lib.all_to_all(x.reshape(n, -1, x.shape[1]), ax, 0, 2),
      "ppermute": lambda x: lib.ppermute(x, ax, perm),
  }


def _run_all(mesh, ax, x, names):
  n = int(np.prod([mesh.shape[a] for a in (ax if isinstance(ax, tuple) else (ax,))]))
  spec = P(mesh.axis_names)  # shard rows over every mesh axis

  def body(lib):
    def f(x):
      ops = _ops(lib, ax, n)
      # Every device's result, stacked along a new leading dimension.
      return {k: ops[k](x)[None] for k in names}
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))

  xs = put(x, mesh, spec)
  ref = body(jax.lax)(xs)
  return body(dc)(xs), ref


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("mesh_cfg", MESHES, ids=lambda m: f"{'x'.join(map(str, m[0]))}-{m[2]}")
@pytest.mark.parametrize("rows", [1, 3])  # local block (rows*n, 8*n): tiny and odd sizes
def test_parity_grid(dtype, mesh_cfg, rows):
  shape, names, ax = mesh_cfg
  mesh = cpu_mesh(shape, names)
  n = int(np.prod([mesh.shape[a] for a in (ax if isinstance(ax, tuple) else (ax,))]))
  ndev = mesh.size
  ops = list(_ops(jax.lax, ax, n))
  if ax == ("y", "x"):
    ops.remove("ppermute")  # jax.lax refuses axis tuples out of mesh order here
  with jax.enable_x64(np.dtype(dtype) == np.float64):
    x = _rand((ndev * rows * n, 2 * n), dtype, seed=rows)
    ours, ref = _run_all(mesh, ax, x, ops)
  for k in ops:
    assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape, k
    np.testing.assert_array_equal(np.asarray(ours[k], np.float64), np.asarray(ref[k], np.float64),
                                  err_msg=k)


def test_single_element(mesh8):
  x = put(jnp.arange(8, dtype=jnp.float32), mesh8, P("x"))
  f = lambda lib: jax.jit(jax.shard_map(lambda v: (lib.psum(v, "x"), lib.all_gather(v, "x")),
                                        mesh=mesh8, in_specs=P("x"), out_specs=(P(), P("x"))))
  for a, b in zip(f(dc)(x), f(jax.lax)(x)):
    np.testing.assert_array_equal(a, b)


def test_float_random_values(mesh24):
  """Non-integer values: equal to jax.lax up to summation-order rounding."""
  x = put(jax.random.normal(jax.random.key(0), (64, 32)), mesh24, P("x", "y"))
  f = lambda lib: jax.jit(jax.shard_map(
      lambda v: (lib.psum(v, ("x", "y")), lib.psum_scatter(v, "y", tiled=True)),
      mesh=mesh24, in_specs=P("x", "y"), out_specs=(P(), P("x", "y"))))
  for a, b in zip(f(dc)(x), f(jax.lax)(x)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_float64(mesh8):
  with jax.enable_x64(True):
    x = put(jnp.asarray(np.random.default_rng(1).normal(size=(8, 5))), mesh8, P("x"))
    assert x.dtype == jnp.float64
    f = lambda lib: jax.jit(jax.shard_map(
        lambda v: (lib.psum(v, "x"), lib.all_gather(v, "x", tiled=True)),
        mesh=mesh8, in_specs=P("x"), out_specs=(P(), P("x"))))
    for a, b in zip(f(dc)(x), f(jax.lax)(x)):
      assert a.dtype == np.float64
      np.testing.assert_allclose(a, b, rtol=1e-13)


@pytest.mark.parametrize("mib", [1, 64])
def test_large_messages(mesh8, mib):
  """Per-device messages of 1 MiB and 64 MiB (float32) for every op (all_gather: the
  gathered result is 64 MiB per device)."""
  per_dev = mib * (1 << 20) // 4
  x = put(jnp.arange(8 * per_dev, dtype=jnp.float32).reshape(8, per_dev) % 7, mesh8, P("x"))
  ring = [(i, (i + 1) % 8) for i in range(8)]
  g = lambda lib: jax.jit(jax.shard_map(
      lambda v: (lib.psum(v, "x"), lib.all_gather(v[:, : per_dev // 8], "x", tiled=True),
                 lib.psum_scatter(v.reshape(8, -1), "x"),
                 lib.all_to_all(v.reshape(8, -1), "x", 0, 0, tiled=True),
                 lib.ppermute(v, "x", ring)),
      mesh=mesh8, in_specs=P("x"), out_specs=(P(), P("x"), P("x"), P("x"), P("x"))))
  for a, b in zip(g(dc)(x), g(jax.lax)(x)):
    np.testing.assert_array_equal(a, b)


def test_pytree_and_start_done(mesh24):
  tree = {"a": jnp.ones((8, 4)), "b": (jnp.arange(16.0).reshape(8, 2),)}
  tree = jax.tree.map(lambda v: put(v, mesh24, P("x")), tree)

  def f(lib_psum, t):
    return lib_psum(t, "x")

  def ours(t):
    h = dc.psum_start(t, "x")
    return dc.done(h)

  sm = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh24, in_specs=P("x"), out_specs=P()))
  a = sm(ours)(tree)
  b = sm(functools.partial(f, dc.psum))(tree)
  c = sm(functools.partial(f, jax.lax.psum))(tree)
  for u, v, w in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c)):
    np.testing.assert_array_equal(u, w)
    np.testing.assert_array_equal(v, w)


def test_invariant_input_like_lax(mesh8):
  """psum of a value invariant over the axis multiplies it by the group size (as jax.lax)."""
  f = lambda lib: jax.jit(jax.shard_map(lambda: lib.psum(jnp.float32(3.0), "x"), mesh=mesh8,
                                        in_specs=(), out_specs=P()))
  np.testing.assert_array_equal(f(dc)(), f(jax.lax)())


@pytest.mark.parametrize("check_vma", [True, False])
def test_check_vma_modes(mesh24, check_vma):
  x = put(_rand((16, 8), np.float32), mesh24, P("x", "y"))
  f = lambda lib: jax.jit(jax.shard_map(
      lambda v: (lib.psum(v, "y"), lib.all_gather(v, "x", tiled=True)), mesh=mesh24,
      in_specs=P("x", "y"), out_specs=(P("x"), P("x", "y")), check_vma=check_vma))
  for a, b in zip(f(dc)(x), f(jax.lax)(x)):
    np.testing.assert_array_equal(a, b)


def test_output_types_match_lax(mesh24):
  """Varying-manual-axes typing equals jax.lax's for every op."""
  def types(lib):
    out = {}

    def f(v):
      for k, op in _ops(lib, "y", 4).items():
        out[k] = jax.typeof(op(v))
      return v
    jax.jit(jax.shard_map(f, mesh=mesh24, in_specs=P("x", "y"), out_specs=P("x", "y"))).trace(
        jax.ShapeDtypeStruct((32, 32), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh24, P("x", "y"))))
    return out
  a, b = types(dc), types(jax.lax)
  for k in a:
    assert str(a[k]) == str(b[k]), (k, a[k], b[k])


def test_ppermute_axes_out_of_mesh_order(mesh24):
  """ppermute over ("y", "x"): ranks are row-major over the axes as given."""
  x = put(jnp.arange(8.0), mesh24, P(("x", "y")))
  perm = [(i, (i + 3) % 8) for i in range(8)]
  f = jax.jit(jax.shard_map(lambda v: dc.ppermute(v, ("y", "x"), perm), mesh=mesh24,
                            in_specs=P(("x", "y")), out_specs=P(("x", "y"))))
  out = np.asarray(f(x))
  # device (x, y) holds value 4x + y and has rank 2y + x over ("y", "x").
  rank = lambda d: 2 * (d % 4) + d // 4
  expect = np.zeros(8)
  for d in range(8):
    src = [s for s in range(8) if rank(s) == (rank(d) - 3) % 8][0]
    expect[d] = src
  np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize("check_vma", [True, False])
def test_pmean_like_lax(mesh24, check_vma):
  """pmean (float and int32 leaves, pytree, start form, an axis tuple) against jax.lax.pmean."""
  xf = put(jnp.asarray(np.random.default_rng(2).standard_normal((8, 5)), jnp.float32), mesh24, P(("x", "y")))
  xi = put(jnp.arange(40, dtype=jnp.int32).reshape(8, 5), mesh24, P(("x", "y")))

  def run(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh24, in_specs=P(("x", "y")), out_specs=P(("x", "y")),
                                 check_vma=check_vma))({"f": xf, "i": xi})

  want = run(lambda t: jax.lax.pmean(t, "y"))
  got = run(lambda t: dc.pmean(t, "y"))
  got_start = run(lambda t: dc.done(dc.pmean_start(t, ("x", "y"))))
  want_xy = run(lambda t: jax.lax.pmean(t, ("x", "y")))
  for g, w in ((got, want), (got_start, want_xy)):
    for k in ("f", "i"):
      assert g[k].dtype == w[k].dtype, k
      np.testing.assert_allclose(np.asarray(g[k]), np.asarray(w[k]), rtol=1e-6, err_msg=k)
