"""Dtypes beyond the runtimes' own: data-movement ops carry any fixed-width dtype as bytes,
small-integer reductions run in int32 and wrap like jax.lax.  Compared with jax.lax on the
same inputs."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import put

N = 8
MOVE_DTYPES = [np.int8, np.uint8, np.bool_, np.int16, np.uint16, np.uint32, np.complex64,
               ml_dtypes.float8_e4m3fn]
REDUCE_DTYPES = [np.int8, np.uint8, np.int16, np.uint16]


def _data(dtype, shape, seed=0):
  rng = np.random.default_rng(seed)
  dt = np.dtype(dtype)
  if dt == np.bool_:
    return rng.integers(0, 2, shape).astype(bool)
  if dt.kind in "iu":
    info = np.iinfo(dt)
    return rng.integers(info.min, int(info.max) + 1, shape).astype(dt)  # full range: sums wrap
  if dt.kind == "c":
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
  return rng.standard_normal(shape).astype(dt)


def _ops(lib):
  return {
      "all_gather": lambda v: lib.all_gather(v, "x"),
      "all_gather_tiled_axis1": lambda v: lib.all_gather(v, "x", axis=1, tiled=True),
      "all_to_all": lambda v: lib.all_to_all(v, "x", 0, 1, tiled=True),
      "ppermute": lambda v: lib.ppermute(v, "x", [(i, (i + 5) % N) for i in range(N)]),
  }


def _run(fn, mesh, x):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))(x)


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(_ops(jax.lax)))
def test_data_movement_any_dtype(mesh8, dtype, op):
  x = put(jnp.asarray(_data(dtype, (N * 8, 3))), mesh8, P("x"))  # 3 columns: odd byte counts
  got, want = _run(_ops(dc)[op], mesh8, x), _run(_ops(jax.lax)[op], mesh8, x)
  assert got.dtype == want.dtype and got.shape == want.shape
  np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["psum", "pmax", "pmin", "psum_scatter", "pmean"])
def test_small_integer_reductions_wrap_like_lax(mesh8, dtype, op):
  x = put(jnp.asarray(_data(dtype, (N * 8, 5), seed=3)), mesh8, P("x"))
  f = {"psum": lambda lib: lambda v: lib.psum(v, "x"),
       "pmax": lambda lib: lambda v: lib.pmax(v, "x"),
       "pmin": lambda lib: lambda v: lib.pmin(v, "x"),
       "psum_scatter": lambda lib: lambda v: lib.psum_scatter(v, "x", tiled=True),
       "pmean": lambda lib: lambda v: lib.pmean(v, "x")}[op]
  got, want = _run(f(dc), mesh8, x), _run(f(jax.lax), mesh8, x)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", [np.bool_, np.uint32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["psum", "pmax", "pmin", "pmean", "psum_scatter"])
def test_bool_and_uint32_reductions_as_lax(mesh8, dtype, op):
  # jax.lax sums bools as int32 (a count); uint32 sums wrap; uint32 max/min are unsigned.
  x = put(jnp.asarray(_data(dtype, (N * 8, 5), seed=4)), mesh8, P("x"))
  f = {"psum": lambda lib: lambda v: lib.psum(v, "x"),
       "pmax": lambda lib: lambda v: lib.pmax(v, "x"),
       "pmin": lambda lib: lambda v: lib.pmin(v, "x"),
       "pmean": lambda lib: lambda v: lib.pmean(v, "x"),
       "psum_scatter": lambda lib: lambda v: lib.psum_scatter(v, "x", tiled=True)}[op]
  if op == "psum_scatter" and dtype == np.bool_:  # refused by jax.lax: by us too
    for lib in (jax.lax, dc):
      with pytest.raises(TypeError, match="bool"):
        _run(f(lib), mesh8, x)
    return
  want = _run(f(jax.lax), mesh8, x)
  got = _run(f(dc), mesh8, x)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unsupported_reduction_dtype_is_a_trace_time_error(mesh8):
  x = put(jnp.zeros((N, 2), ml_dtypes.float8_e4m3fn), mesh8, P("x"))
  with pytest.raises(TypeError, match="unsupported dtype float8_e4m3fn"):
    _run(lambda v: dc.psum(v, "x"), mesh8, x)


@pytest.mark.parametrize("case", ["untiled_dim0", "tiled_dim1", "tiled_negative_dim", "pytree"])
def test_complex_psum_scatter_as_lax(mesh8, case):
  """Complex sums scatter as jax.lax's (a sum of (real, imag) pairs below the scattered dimension),
  the scatter dimension counted in the caller's rank, negative ones too; and its gradient."""
  shape, kw = {"untiled_dim0": ((N * N, 3), dict(scatter_dimension=0)),
               "tiled_dim1": ((N, 2 * N, 3), dict(scatter_dimension=1, tiled=True)),
               "tiled_negative_dim": ((N, 3, 2 * N), dict(scatter_dimension=-1, tiled=True)),
               "pytree": ((N * N, 2), dict(scatter_dimension=0))}[case]
  x = put(jnp.asarray(_data(np.complex64, shape, seed=7)), mesh8, P("x"))
  if case == "pytree":
    f = lambda lib: lambda v: lib.psum_scatter({"c": v, "r": jnp.real(v)}, "x", **kw)  # noqa: E731
    got, want = _run(f(dc), mesh8, x), _run(f(jax.lax), mesh8, x)
    for k in ("c", "r"):
      assert got[k].dtype == want[k].dtype
      np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-5)
    return
  f = lambda lib: lambda v: lib.psum_scatter(v, "x", **kw)  # noqa: E731
  got, want = _run(f(dc), mesh8, x), _run(f(jax.lax), mesh8, x)
  assert got.dtype == want.dtype and got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  loss = lambda lib: lambda v: jnp.sum(jnp.abs(lib.psum_scatter(v, "x", **kw)) ** 2)  # noqa: E731
  grad = lambda lib: jax.jit(jax.shard_map(jax.grad(loss(lib)), mesh=mesh8, in_specs=P("x"),  # noqa: E731
                                           out_specs=P("x"), check_vma=False))(x)
  np.testing.assert_allclose(np.asarray(grad(dc)), np.asarray(grad(jax.lax)), rtol=1e-4, atol=1e-4)
