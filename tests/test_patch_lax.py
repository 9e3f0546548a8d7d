"""patch_lax(): unmodified jax.lax collective code traced on jax_dfccl."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import put

N = 8
NAMES = ("psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute", "pshuffle")


def layer(x):
  """A 'library' function written against jax.lax (module attribute lookups at trace time)."""
  outs = [
      lax.psum(x, "x"),
      lax.pmean(x, "x"),
      jax.lax.pmax(x, "x"),
      jax.lax.pmin(x, "x"),
      lax.all_gather(x, "x", axis=1, tiled=True),
      lax.psum_scatter(x, "x", scatter_dimension=0, tiled=True),
      lax.all_to_all(x, "x", 0, 1, tiled=True),
      lax.ppermute(x, "x", [(i, (i + 3) % N) for i in range(N)]),
      lax.pshuffle(x, "x", [(i + 5) % N for i in range(N)]),
      x * lax.psum(1, "x"),  # the axis-size idiom: no communication
  ]
  return tuple(outs)


def _program(mesh):
  return jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))


def test_patched_program_matches_lax(mesh8):
  rng = np.random.default_rng(0)
  x = put(jnp.asarray(rng.integers(-20, 20, (N * N, 16)), jnp.float32), mesh8, P("x"))
  want = _program(mesh8)(x)
  with dc.patch_lax():
    f = _program(mesh8)
    txt = f.trace(x).lower().as_text()
    got = f(x)
  calls = re.findall(r"custom_call @(dfccl_\w+)", txt)
  assert len([c for c in calls if c == "dfccl_start"]) == len(NAMES)  # one per collective, none for psum(1)
  # ... and no XLA collective left (psum(1, ...) is folded to the axis size).
  assert not re.findall(r"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)", txt)
  for name, a, b in zip(NAMES + ("axis_size",), got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, err_msg=name)


def test_restored_after_block_and_nesting():
  before = {n: getattr(jax.lax, n) for n in NAMES}
  with dc.patch_lax():
    inner = jax.lax.psum
    with dc.patch_lax():
      assert jax.lax.psum is inner
    assert jax.lax.psum is inner  # still patched: the outer block is open
    assert jax.lax.psum is not before["psum"]
  assert {n: getattr(jax.lax, n) for n in NAMES} == before


def test_restored_after_error():
  before = jax.lax.psum
  with pytest.raises(RuntimeError):
    with dc.patch_lax():
      raise RuntimeError("boom")
  assert jax.lax.psum is before


def test_axis_index_groups_passed_on(mesh8):
  groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
  f = lambda: jax.jit(jax.shard_map(  # noqa: E731
      lambda v: (lax.pmean(v, "x", axis_index_groups=groups), lax.all_gather(v, "x", axis_index_groups=groups)),
      mesh=mesh8, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  x = put(jnp.arange(N * 2.0), mesh8, P("x"))
  want = f()(x)
  with dc.patch_lax():
    g = f()
    assert "dfccl_" in g.trace(x).lower().as_text()
    got = g(x)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@pytest.mark.skipif(not hasattr(jax.lax, "psum_scatter_start"), reason="jax.lax has no psum_scatter_start")
def test_async_psum_scatter_start_swapped(mesh8):
  def f(v):
    fut = jax.lax.psum_scatter_start(v, "x", scatter_dimension=0, tiled=True)
    return fut.done() * 2
  x = put(jnp.arange(N * N * 2.0).reshape(N * N, 2), mesh8, P("x"))
  prog = lambda: jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=P("x"), out_specs=P("x")))  # noqa: E731
  want = prog()(x)
  with dc.patch_lax():
    g = prog()
    assert "dfccl_start" in g.trace(x).lower().as_text()
    got = g(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(want), 2 * np.asarray(x).reshape(N, N, 2).sum(0))


def test_all_gather_to_through_patch(mesh8):
  f = lambda v: jax.lax.all_gather(v, "x", tiled=True, to="invarying")  # noqa: E731
  x = put(jnp.arange(N * 2.0), mesh8, P("x"))
  prog = lambda: jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=P("x"), out_specs=P()))  # noqa: E731
  want = prog()(x)
  with dc.patch_lax():
    got = prog()(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_manual_enter_not_undone_by_garbage_collection(monkeypatch):
  import gc
  import weakref
  from jax_dfccl._src import patch
  before = {n: getattr(jax.lax, n) for n in NAMES}
  for n, f in before.items():  # restored at teardown, whatever the test leaves
    monkeypatch.setattr(jax.lax, n, f)
  monkeypatch.setattr(patch, "_depth", 0)
  monkeypatch.setattr(patch, "_originals", {})
  cm = dc.patch_lax()
  cm.__enter__()
  alive = weakref.ref(cm)
  del cm
  gc.collect()
  assert alive() is None  # the object is gone ...
  assert all(getattr(jax.lax, n) is not before[n] for n in NAMES)  # ... and jax.lax stays patched


def test_manual_enter_exit_and_misuse_refused():
  before = jax.lax.psum
  cm = dc.patch_lax()
  with pytest.raises(RuntimeError, match="without a matching __enter__"):
    cm.__exit__(None, None, None)
  assert cm.__enter__() is cm
  try:
    assert jax.lax.psum is not before
    with pytest.raises(RuntimeError, match="already entered"):
      cm.__enter__()
    with dc.patch_lax():  # a second object nests
      assert jax.lax.psum is not before
    assert jax.lax.psum is not before
  finally:
    cm.__exit__(None, None, None)
  assert jax.lax.psum is before
  with cm:  # the object can be entered again once exited
    assert jax.lax.psum is not before
  assert jax.lax.psum is before
