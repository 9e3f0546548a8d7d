"""Reductions of pytrees: leaves of one dtype share one collective (a bucket); results,
start form and gradients as jax.lax."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import put

N = 8


def _tree(mesh):
  rng = np.random.default_rng(4)
  t = {"w": rng.standard_normal((N * 3, 5)).astype(np.float32),
       "b": rng.standard_normal((N * 2,)).astype(np.float32),
       "h": rng.standard_normal((N, 7)).astype(jnp.bfloat16),
       "s": rng.integers(-100, 100, (N * 4, 2)).astype(np.int8),
       "i": rng.integers(-1000, 1000, (N, 3)).astype(np.int32)}
  return {k: put(jnp.asarray(v), mesh, P("x")) for k, v in t.items()}


def _smap(f, mesh, check_vma=False):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=check_vma))


def test_pytree_reductions_match_lax_with_one_call_per_dtype(mesh8):
  t = _tree(mesh8)
  for ours, ref in ((dc.psum, jax.lax.psum), (dc.pmax, jax.lax.pmax), (dc.pmin, jax.lax.pmin),
                    (dc.pmean, jax.lax.pmean)):
    f = _smap(lambda v, o=ours: o(v, "x"), mesh8)
    got, want = f(t), _smap(lambda v, r=ref: r(v, "x"), mesh8)(t)
    for k in t:
      assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
      np.testing.assert_allclose(np.asarray(got[k], np.float64), np.asarray(want[k], np.float64),
                                 rtol=2e-2 if k == "h" else 1e-6, err_msg=f"{ours.__name__} {k}")
    # float32 (w, b), bfloat16 (h), int32 (i, and s carried as int32): 3 collectives, not 5.
    calls = re.findall(r"custom_call @(dfccl_start)", f.lower(t).as_text())
    assert len(calls) == 3, (ours.__name__, calls)


def test_bucket_start_form_and_order(mesh8):
  t = _tree(mesh8)
  got = _smap(lambda v: dc.done(dc.psum_start(v, "x")), mesh8)(t)
  want = _smap(lambda v: jax.lax.psum(v, "x"), mesh8)(t)
  for k in ("w", "b", "s", "i"):
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


def test_bucket_gradient(mesh8):
  t = _tree(mesh8)
  params = {"w": t["w"], "b": t["b"]}

  def loss(red):
    def f(p):
      s = _smap(lambda v: red(v, "x"), mesh8, check_vma=True)(p)
      return jnp.sum(s["w"] ** 2) + jnp.sum(jnp.sin(s["b"]))
    return f

  g_ours, g_ref = jax.grad(loss(dc.psum))(params), jax.grad(loss(jax.lax.psum))(params)
  for k in params:
    np.testing.assert_allclose(np.asarray(g_ours[k]), np.asarray(g_ref[k]), rtol=1e-5, err_msg=k)


def test_pytree_data_movement_in_buckets(mesh8):
  """all_gather (stacked and tiled), psum_scatter, all_to_all and ppermute of pytrees: one
  collective per dtype, results as jax.lax (an int8 leaf travels as bytes in the int32 bucket)."""
  rng = np.random.default_rng(6)
  t = {"a": rng.standard_normal((N * 8, 3)).astype(np.float32),
       "b": rng.standard_normal((N * 16,)).astype(np.float32),
       "c": rng.integers(-5, 5, (N * 8, 4)).astype(np.int32),
       "d": rng.integers(-100, 100, (N * 8, 2)).astype(np.int8)}
  t = {k: put(jnp.asarray(v), mesh8, P("x")) for k, v in t.items()}
  perm = [(i, (i + 3) % N) for i in range(N)]
  cases = {
      "all_gather": lambda lib: lambda v: lib.all_gather(v, "x"),
      "all_gather_tiled": lambda lib: lambda v: lib.all_gather(v, "x", tiled=True),
      "psum_scatter": lambda lib: lambda v: lib.psum_scatter({k: v[k] for k in "abc"}, "x", tiled=True),
      "all_to_all": lambda lib: lambda v: lib.all_to_all(v, "x", 0, 0, tiled=True),
      "ppermute": lambda lib: lambda v: lib.ppermute(v, "x", perm),
  }
  for name, f in cases.items():
    spec = P("x")
    run = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh8, in_specs=spec, out_specs=spec,  # noqa: E731
                                           check_vma=False))
    g = run(f(dc))
    got, want = g(t), run(f(jax.lax))(t)
    for k in want:
      assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (name, k)
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=f"{name} {k}")
    calls = re.findall(r"custom_call @(dfccl_start)", g.lower(t).as_text())
    assert len(calls) == 2, (name, calls)  # float32 (a, b) and int32 words (c, d)


def test_bucketed_all_gather_gradient(mesh8):
  """The transpose of a bucketed all_gather is a bucketed psum_scatter: gradients as jax.lax."""
  rng = np.random.default_rng(7)
  p = {"w": put(jnp.asarray(rng.standard_normal((N * 2, 3)), jnp.float32), mesh8, P("x")),
       "b": put(jnp.asarray(rng.standard_normal((N * 4,)), jnp.float32), mesh8, P("x"))}

  def loss(lib):
    f = jax.jit(jax.shard_map(lambda v: lib.all_gather(v, "x", tiled=True), mesh=mesh8, in_specs=P("x"),
                              out_specs=P("x"), check_vma=False))
    return lambda v: (lambda g: jnp.sum(jnp.tanh(g["w"]) * 3.0) + jnp.sum(g["b"] ** 3))(f(v))

  g_ours, g_ref = jax.grad(loss(dc))(p), jax.grad(loss(jax.lax))(p)
  for k in p:
    np.testing.assert_allclose(np.asarray(g_ours[k]), np.asarray(g_ref[k]), rtol=1e-5, err_msg=k)
