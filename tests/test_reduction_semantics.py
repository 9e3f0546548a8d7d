"""The reduction library's semantics (xla_ffi/include/dfccl/reduce.h) against
jax.lax on the CPU backend: NaN, +-inf and -0.0 in every position, every
reduction, every float dtype, bit for bit (sign of zero and NaN included)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import put

NAN, INF = np.nan, np.inf
COLUMNS = [
    [NAN, 1, 2, 3, 4, 5, 6, 7], [1, 2, 3, NAN, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, NAN], [NAN] * 8,
    [-0.0, 0.0] * 4, [0.0, -0.0] * 4, [-0.0] * 8, [0.0] * 8, [INF, -INF, 1, 2, 3, 4, 5, 6],
    [NAN, INF, -INF, 1, 2, 3, 4, 5], [1, 2, NAN, INF, -INF, NAN, 4, 5], [-INF] * 8, [INF] * 8,
    [-INF, NAN] * 4, [INF, -0.0, NAN, 0.0, -INF, 1, 1, 1],
]


def _bits(a):
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16, np.float64])
@pytest.mark.parametrize("op", ["psum", "pmax", "pmin", "pmean", "psum_scatter"])
def test_special_values_equal_jax_lax(mesh8, dtype, op):
  x = np.array(COLUMNS, np.float64).T  # (8 ranks, columns)
  x = np.concatenate([x] * 8, axis=1).astype(dtype)  # psum_scatter needs 8 | columns
  xs = put(jnp.asarray(x), mesh8, P("x"))

  def call(lib):
    if op == "psum_scatter":
      return lambda v: lib.psum_scatter(v, "x", scatter_dimension=1, tiled=True)
    return lambda v: getattr(lib, op)(v, "x")[None] if op != "pmean" else lib.pmean(v, "x")[None]

  def run(lib):
    return np.asarray(jax.jit(jax.shard_map(call(lib), mesh=mesh8, in_specs=P("x"), out_specs=P("x"),
                                            check_vma=False))(xs))
  got, want = run(dc), run(jax.lax)
  np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("op", ["pmax", "pmin", "psum"])
def test_int32_extremes_equal_jax_lax(mesh8, op):
  info = np.iinfo(np.int32)
  cols = [[info.max] * 8, [info.min] * 8, [info.max, 1, 0, 0, 0, 0, 0, 0], [info.min, -1, 0, 0, 0, 0, 0, 0],
          [0, info.min, info.max, -1, 1, 2, 3, 4]]
  xs = put(jnp.asarray(np.array(cols, np.int64).T.astype(np.int32)), mesh8, P("x"))
  run = lambda lib: np.asarray(jax.jit(jax.shard_map(lambda v: getattr(lib, op)(v, "x")[None], mesh=mesh8,
                                                     in_specs=P("x"), out_specs=P("x")))(xs))
  np.testing.assert_array_equal(run(dc), run(jax.lax))  # sums wrap as jax.lax's do
