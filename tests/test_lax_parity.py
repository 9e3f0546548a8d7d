"""Drop-in details checked against jax.lax on the same programs: signatures, argument
errors, `to=` of all_gather, reduced/unreduced inputs and their transposes, remat,
the default-key warning inside rank-dependent branches.  (JAX's own shard_map tests
with these collectives swapped in: tools/jax_suite.py, tests/test_jax_suite.py.)"""
import inspect
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import put

N = 8
PUBLIC = ("psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute")


def _explicit_mesh(shape, names):
  from jax.sharding import AxisType
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names),
                       devices=jax.devices("cpu")[: int(np.prod(shape))])


# ---------------------------------------------------------------- signatures and argument errors


@pytest.mark.parametrize("name", PUBLIC)
def test_signature_is_lax_plus_key(name):
  lax_sig = inspect.signature(getattr(jax.lax, name))
  for f in (getattr(dc, name), getattr(dc, name + "_start")):
    sig = inspect.signature(f)
    assert list(sig.parameters) == list(lax_sig.parameters) + ["key"], (name, sig)
    for p, q in zip(sig.parameters.values(), lax_sig.parameters.values()):
      assert (p.kind, p.default) == (q.kind, q.default), (name, p, q)
    assert sig.parameters["key"].default is None
    assert sig.parameters["key"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("name", ["psum", "all_gather_start"])
def test_wrong_keyword_names_the_public_function(mesh8, name):
  f = jax.shard_map(lambda v: getattr(dc, name)(v, "x", tiles=True), mesh=mesh8, in_specs=P("x"),
                    out_specs=P("x"))
  with pytest.raises(TypeError, match=rf"jax_dfccl\.{name}\(\): got an unexpected keyword argument 'tiles'"):
    jax.jit(f).trace(put(jnp.zeros(N), mesh8, P("x")))


@pytest.mark.parametrize("lib", [jax.lax, dc], ids=["lax", "dfccl"])
def test_ppermute_iterator_perm_refused_as_lax(mesh8, lib):
  perm = zip(range(N), [(i + 1) % N for i in range(N)])
  f = jax.shard_map(lambda v: lib.ppermute(v, "x", perm), mesh=mesh8, in_specs=P("x"), out_specs=P("x"))
  with pytest.raises(TypeError, match="`perm` passed to `jax.lax.ppermute` must be a list"):
    jax.jit(f)(put(jnp.zeros(N), mesh8, P("x")))


@pytest.mark.parametrize("lib", [jax.lax, dc], ids=["lax", "dfccl"])
def test_unbound_axis_message_as_lax(lib):
  with pytest.raises(NameError, match="Found an unbound axis name: x. To fix this, please call psum "
                                      "under `jax.shard_map`"):
    jax.jit(lambda v: lib.psum(v, "x"))(jnp.arange(8.0))


# ---------------------------------------------------------------- all_gather(to=...)


def _ag_program(lib, to, mesh):
  @jax.jit
  @partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P())
  def f(v):
    g = lib.all_gather(v, "x", axis=0, tiled=True, to=to)
    assert "x" not in jax.typeof(g).mat.varying
    return jnp.sum(jnp.sin(g) * jnp.arange(g.shape[0], dtype=g.dtype)[:, None], axis=0)
  return f


def test_all_gather_to_invarying_value_type_and_grad(mesh8):
  x = put(jnp.asarray(np.random.default_rng(0).standard_normal((N * 2, 3)), jnp.float32), mesh8, P("x"))
  want, got = _ag_program(jax.lax, "invarying", mesh8), _ag_program(dc, "invarying", mesh8)
  np.testing.assert_allclose(got(x), want(x), rtol=1e-6)
  g = lambda f: jax.jit(jax.grad(lambda v: f(v).sum()))(x)  # noqa: E731
  np.testing.assert_allclose(g(got), g(want), rtol=1e-6)
  txt = jax.jit(jax.grad(lambda v: got(v).sum())).trace(x).lower().as_text()
  assert txt.count("dfccl_start") == 1  # the transpose is a slice: no second collective


def test_all_gather_bad_to_refused_as_lax(mesh8):
  for lib in (jax.lax, dc):
    f = jax.shard_map(lambda v: lib.all_gather(v, "x", to="unreduced"), mesh=mesh8, in_specs=P("x"),
                      out_specs=P("x"))
    with pytest.raises(ValueError, match="unexpected `to` value"):
      jax.jit(f).trace(put(jnp.zeros(N), mesh8, P("x")))


def _reduced_program(lib, mesh):
  # all_gather(to='reduced') forward; its transpose is a reduce-scatter of an unreduced cotangent.
  @jax.shard_map(mesh=mesh, in_specs=P("y"), out_specs=P(None, None, reduced={"y"}))
  def ag(a):
    out = lib.all_gather(a, "y", tiled=True, to="reduced")
    assert out.aval.mat.reduced == {"y"} and not out.aval.mat.varying
    return out

  def f(x, w):
    return jnp.sin(jnp.einsum("td,df->tf", x, ag(w))).sum()
  return f


def test_all_gather_reduced_fwd_unreduced_psum_scatter_bwd():
  mesh = _explicit_mesh((2, 4), ("x", "y"))
  rng = np.random.default_rng(1)
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.asarray(rng.standard_normal((8, 4)), jnp.float32), P("y", None))
    w = jax.device_put(jnp.asarray(rng.standard_normal((4, 6)), jnp.float32), P("y", None))
    outs = {}
    for name, lib in (("lax", jax.lax), ("dfccl", dc)):
      f = _reduced_program(lib, mesh)
      outs[name] = (jax.jit(f)(x, w), *jax.jit(jax.grad(f, argnums=(0, 1)))(x, w))
    txt = jax.jit(jax.grad(_reduced_program(dc, mesh), argnums=(0, 1))).trace(x, w).lower().as_text()
  assert txt.count("dfccl_start") == 2  # all_gather and its reduce-scatter transpose
  for a, b in zip(outs["dfccl"], outs["lax"]):
    assert a.sharding == b.sharding
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)  # float64 reference of dL/dw
  np.testing.assert_allclose(outs["dfccl"][2], xn.T @ np.cos(xn @ wn), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- unreduced inputs


@pytest.mark.parametrize("op", ["psum", "psum_scatter"])
def test_unreduced_input_fwd_and_bwd_as_lax(op):
  mesh = _explicit_mesh((4,), ("x",))
  rng = np.random.default_rng(2)
  with jax.set_mesh(mesh):
    a = jax.device_put(jnp.asarray(rng.standard_normal((8, 8)), jnp.float32), P(None, "x"))
    b = jax.device_put(jnp.asarray(rng.standard_normal((8, 12)), jnp.float32), P("x", None))
    outs = {}
    for name, lib in (("lax", jax.lax), ("dfccl", dc)):
      if op == "psum":
        body, out_spec = (lambda z, lib=lib: lib.psum(z, "x")), P()
      else:
        body, out_spec = (lambda z, lib=lib: lib.psum_scatter(z, "x", tiled=True)), P("x", None)
      red = jax.shard_map(body, in_specs=P(unreduced={"x"}), out_specs=out_spec)

      def f(a, b, red=red):
        z = jnp.einsum("ab,bc->ac", a, b, out_sharding=P(unreduced={"x"}))
        return jnp.sin(red(z)).sum()
      outs[name] = (jax.jit(f)(a, b), *jax.jit(jax.grad(f, argnums=(0, 1)))(a, b))
  for x, y in zip(outs["dfccl"], outs["lax"]):
    assert x.sharding == y.sharding
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- remat


def _remat_program(lib, mesh, policy=None):
  @partial(jax.checkpoint, policy=policy)
  @partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  def f(x):
    return jnp.sin(lib.all_gather(x, "x", tiled=True)) * lib.psum(x, "x").sum()
  return f


def test_collectives_not_saved_under_checkpoint(mesh8):
  from jax._src.ad_checkpoint import saved_residuals
  x = put(jnp.arange(16.0), mesh8, P("x"))
  res = {name: [str(a) for a, _ in saved_residuals(_remat_program(lib, mesh8), x)]
         for name, lib in (("lax", jax.lax), ("dfccl", dc))}
  assert res["dfccl"] == res["lax"]
  g = lambda lib: jax.jit(jax.grad(lambda v: _remat_program(lib, mesh8)(v).sum()))(x)  # noqa: E731
  np.testing.assert_allclose(g(dc), g(jax.lax), rtol=1e-5)


def test_checkpoint_policy_naming_a_lax_collective(mesh8):
  from jax._src.ad_checkpoint import saved_residuals
  from jax._src.lax import parallel
  save_gathers = lambda prim, *_, **__: prim is parallel.all_gather_p  # noqa: E731
  x = put(jnp.arange(16.0), mesh8, P("x"))
  res = {name: sorted(a.size for a, _ in saved_residuals(_remat_program(lib, mesh8, save_gathers), x))
         for name, lib in (("lax", jax.lax), ("dfccl", dc))}
  # The gathered values are saved (ours in its canonical (n, *S) layout: the same elements).
  assert res["dfccl"] == res["lax"] and N * 16 in res["lax"]
  everything = jax.checkpoint_policies.everything_saveable
  assert len(saved_residuals(_remat_program(dc, mesh8, everything), x)) > len(res["dfccl"])


# ---------------------------------------------------------------- default keys in branches


def _branchy(mesh, index_fn, keyed):
  kw = lambda k: {"key": k} if keyed else {}  # noqa: E731

  def body(v):
    return jax.lax.switch(index_fn(), [lambda u: dc.psum(u, "x", **kw("s")) * 2.0,
                                       lambda u: dc.psum(u, "x", **kw("s")) * 3.0], v)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def test_default_keys_in_rank_dependent_switch_warn(mesh8):
  x = put(jnp.arange(16.0), mesh8, P("x"))
  with pytest.warns(dc.DefaultKeyInBranchWarning, match="give the collectives|Give the collectives"):
    _branchy(mesh8, lambda: jax.lax.axis_index("x") % 2, keyed=False).trace(x)
  with warnings.catch_warnings():
    warnings.simplefilter("error", dc.DefaultKeyInBranchWarning)
    out = _branchy(mesh8, lambda: jax.lax.axis_index("x") % 2, keyed=True)(x)  # keyed: no warning
    _branchy(mesh8, lambda: jnp.int32(1), keyed=False).trace(x)  # the same branch on every rank
  s = np.asarray(x).reshape(N, 2).sum(0)
  want = np.concatenate([s * (2.0 if i % 2 == 0 else 3.0) for i in range(N)])
  np.testing.assert_allclose(out, want)


def test_branch_index_varying_over_other_axis_does_not_warn(mesh24):
  x = put(jnp.arange(16.0).reshape(2, 8), mesh24, P("x", "y"))
  f = jax.shard_map(lambda v: jax.lax.cond(jax.lax.axis_index("x") == 0, lambda u: dc.psum(u, "y"),
                                           lambda u: dc.psum(u, "y") * 2, v),
                    mesh=mesh24, in_specs=P("x", "y"), out_specs=P("x"))
  with warnings.catch_warnings():
    warnings.simplefilter("error", dc.DefaultKeyInBranchWarning)
    got = jax.jit(f)(x)  # every rank of a "y" group takes the same branch
  np.testing.assert_allclose(got, np.asarray(x).reshape(2, 4, 2).sum(1) * np.array([[1.0], [2.0]]))


def test_ppermute_axes_in_other_order_than_mesh():
  # jax.lax refuses axis_name=('y', 'x') on an ('x', 'y') mesh at run time (an XLA limitation);
  # ours runs it, ranks numbered as axis_index(('y', 'x')) numbers them.
  mesh = _explicit_mesh((2, 2), ("x", "y"))
  with jax.set_mesh(mesh):
    inp = jax.device_put(jnp.arange(4), P(("y", "x")))
    f = jax.jit(jax.shard_map(lambda v: dc.ppermute(v, ("y", "x"), [(0, 1), (1, 2), (2, 3), (3, 0)]),
                              in_specs=P(("y", "x")), out_specs=P(("y", "x"))))
    np.testing.assert_array_equal(np.asarray(f(inp)), [3, 0, 1, 2])
