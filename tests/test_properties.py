"""Property-based tests of every public collective against jax.lax on the same
input (hypothesis, fixed seed, bounded examples): random shapes (0-size,
scalars per shard, odd sizes), dtypes, axis names and tuples (unbound,
repeated, out of mesh order), tiled, dimensions (negative, out of range),
permutations (duplicates, out of range, partial), axis_index_groups and keys.

The oracle: the same result as jax.lax, or an error when the function is
traced — and when jax_dfccl raises, its message names the public function.
Never a crash, a hang (every example runs under the runtime's timeout) or a
different result.  Counts of outcomes are printed at the end of the module."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import jax_dfccl as dc  # noqa: E402
from conftest import cpu_mesh, put  # noqa: E402

MESH = None
# Where jax.lax accepts input whose meaning it does not define and jax_dfccl refuses it at
# trace time (the message names the function and the argument): a rank pair outside the axis
# (jax.lax.ppermute passes (0, -1) to XLA unchecked).
STRICTER = ("has ranks outside",)
OUTCOMES = collections.Counter()
SETTINGS = settings(max_examples=30, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

DTYPES = [np.float32, np.float16, jnp.bfloat16, np.float64, np.int32, np.int8, np.uint8, np.int16, np.uint32,
          np.bool_, np.complex64]
AXES = ["x", "y", ("x", "y"), ("y", "x"), "z"]
# Axis names that jax.lax does not check before XLA aborts the process (a repeated axis) or
# that it refuses: jax_dfccl must raise at trace time, naming the function.
BAD_AXES = [("x", "x"), (), ("z",), ("x", "q")]


def mesh():
  global MESH
  if MESH is None:
    MESH = cpu_mesh((2, 4), ("x", "y"))
  return MESH


def _values(shape, dtype, seed):
  rng = np.random.default_rng(seed)
  v = rng.integers(-3, 4, size=shape)  # small integers: every summation order is exact
  if np.dtype(dtype) == np.bool_:
    v = v > 0
  elif np.dtype(dtype).kind == "u":
    v = np.abs(v)
  return np.asarray(v).astype(dtype)


@st.composite
def arrays(draw):
  nd = draw(st.integers(0, 3))
  local = tuple(draw(st.sampled_from([0, 1, 2, 3, 4, 8])) for _ in range(nd))
  dtype = draw(st.sampled_from(DTYPES))
  return local, dtype, draw(st.integers(0, 2 ** 16))


def _run(fn, local, dtype, seed):
  """fn under shard_map on the (2, 4) mesh, each device holding a `local`-shaped block."""
  m = mesh()
  glob = (8,) + local
  x = put(jnp.asarray(_values(glob, dtype, seed)), m, P(("x", "y")))
  f = jax.jit(jax.shard_map(lambda v: fn(v[0])[None] if not isinstance(fn(v[0]), dict) else fn(v[0]),
                            mesh=m, in_specs=P(("x", "y")), out_specs=P(("x", "y")), check_vma=False))
  return np.asarray(f(x))


def _compare(name, ours, ref, local, dtype, seed):
  """Same result, or both refuse; our errors name the public function."""
  try:
    want = _run(ref, local, dtype, seed)
    ref_err = None
  except Exception as e:  # noqa: BLE001 - jax.lax's refusal is the oracle
    want, ref_err = None, e
  try:
    got = _run(ours, local, dtype, seed)
    err = None
  except Exception as e:  # noqa: BLE001
    got, err = None, e
  if err is not None:
    assert not isinstance(err, (SystemError, MemoryError)), f"{name}: crashed: {err!r}"
    if ref_err is None:
      if any(p in str(err) for p in STRICTER):
        OUTCOMES[(name, "refused at trace time where jax.lax is undefined")] += 1
        return
      pytest.fail(f"{name}: jax.lax accepts {local} {np.dtype(dtype)}, jax_dfccl raises {err!r}")
    assert f"jax_dfccl" in str(err) or "jax_dfccl" in type(err).__module__ or _jax_own(err), \
        f"{name}: error does not name jax_dfccl: {err!r}"
    OUTCOMES[(name, "both refuse")] += 1
    return
  if ref_err is not None:
    if "cannot be zero" in str(ref_err) and got.size == 0:
      # XLA's verifier refuses a zero-size gather/scatter dimension; ours returns the empty result.
      OUTCOMES[(name, "empty result where jax.lax refuses zero size")] += 1
      return
    pytest.fail(f"{name}: jax.lax refuses ({ref_err!r}) but jax_dfccl returned a result")
  assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
  np.testing.assert_array_equal(got, want)
  OUTCOMES[(name, "equal")] += 1


def _jax_own(err):
  # Errors JAX raises itself before any collective runs (shard_map's own checks) are fine.
  return type(err).__module__.startswith("jax") and "jax_dfccl" not in str(err)


@pytest.mark.parametrize("op", ["psum", "pmax", "pmin", "pmean", "all_gather", "psum_scatter", "ppermute",
                                "pbroadcast"])
@pytest.mark.parametrize("ax", BAD_AXES)
def test_bad_axis_names_refused(op, ax):
  call = {"all_gather": lambda v: dc.all_gather(v, ax), "psum_scatter": lambda v: dc.psum_scatter(v, ax),
          "ppermute": lambda v: dc.ppermute(v, ax, []), "pbroadcast": lambda v: dc.pbroadcast(v, ax, 0)}.get(
              op, lambda v: getattr(dc, op)(v, ax))
  with pytest.raises((ValueError, NameError), match=r"jax_dfccl(\.\w+)?: "):
    _run(call, (4,), np.float32, 0)
  OUTCOMES[(op, "bad axis refused")] += 1


@SETTINGS
@given(arrays(), st.sampled_from(AXES), st.sampled_from(["psum", "pmax", "pmin", "pmean"]))
def test_reductions(arr, ax, op):
  local, dtype, seed = arr
  _compare(op, lambda v: getattr(dc, op)(v, ax), lambda v: getattr(jax.lax, op)(v, ax), local, dtype, seed)


@SETTINGS
@given(arrays(), st.sampled_from(AXES), st.integers(-4, 4), st.booleans())
def test_all_gather(arr, ax, axis, tiled):
  local, dtype, seed = arr
  _compare("all_gather", lambda v: dc.all_gather(v, ax, axis=axis, tiled=tiled),
           lambda v: jax.lax.all_gather(v, ax, axis=axis, tiled=tiled), local, dtype, seed)


@SETTINGS
@given(arrays(), st.sampled_from(AXES), st.integers(-4, 4), st.booleans())
def test_psum_scatter(arr, ax, dim, tiled):
  local, dtype, seed = arr
  _compare("psum_scatter", lambda v: dc.psum_scatter(v, ax, scatter_dimension=dim, tiled=tiled),
           lambda v: jax.lax.psum_scatter(v, ax, scatter_dimension=dim, tiled=tiled), local, dtype, seed)


@SETTINGS
@given(arrays(), st.sampled_from(AXES), st.integers(-4, 4), st.integers(-4, 4), st.booleans())
def test_all_to_all(arr, ax, split, concat, tiled):
  local, dtype, seed = arr
  _compare("all_to_all", lambda v: dc.all_to_all(v, ax, split, concat, tiled=tiled),
           lambda v: jax.lax.all_to_all(v, ax, split, concat, tiled=tiled), local, dtype, seed)


AXIS_SIZE = {"x": 2, "y": 4, ("x", "y"): 8, ("y", "x"): 8}


@st.composite
def divisible(draw, dtypes=tuple(DTYPES)):
  """Mostly valid input for psum_scatter / all_to_all: one dimension (drawn, maybe as a negative index)
  a multiple of the axis size (exactly it when untiled), the others small; a second dimension index."""
  ax = draw(st.sampled_from(list(AXIS_SIZE)))
  n = AXIS_SIZE[ax]
  nd = draw(st.integers(1, 3))
  dim = draw(st.integers(0, nd - 1))
  tiled = draw(st.booleans())
  local = [draw(st.sampled_from([1, 2, 3])) for _ in range(nd)]
  local[dim] = n * (draw(st.sampled_from([1, 2])) if tiled else 1)
  d = dim - nd if draw(st.booleans()) else dim
  other = draw(st.integers(-nd, nd - 1))
  return (tuple(local), draw(st.sampled_from(dtypes)), draw(st.integers(0, 2 ** 16))), ax, d, other, tiled


@SETTINGS
@given(divisible(dtypes=tuple(d for d in DTYPES if d is not np.bool_)))  # (a sum of bools: both refuse, above)
def test_psum_scatter_valid(case):
  arr, ax, dim, _, tiled = case
  local, dtype, seed = arr
  _compare("psum_scatter[valid]", lambda v: dc.psum_scatter(v, ax, scatter_dimension=dim, tiled=tiled),
           lambda v: jax.lax.psum_scatter(v, ax, scatter_dimension=dim, tiled=tiled), local, dtype, seed)


@SETTINGS
@given(divisible())
def test_all_to_all_valid(case):
  arr, ax, split, concat, tiled = case
  local, dtype, seed = arr
  _compare("all_to_all[valid]", lambda v: dc.all_to_all(v, ax, split, concat, tiled=tiled),
           lambda v: jax.lax.all_to_all(v, ax, split, concat, tiled=tiled), local, dtype, seed)


@st.composite
def perms(draw):
  n = 4  # axis "y"
  k = draw(st.integers(0, 5))
  return [(draw(st.integers(-1, n)), draw(st.integers(-1, n))) for _ in range(k)]


@SETTINGS
@given(arrays(), perms())
def test_ppermute(arr, perm):
  local, dtype, seed = arr
  _compare("ppermute", lambda v: dc.ppermute(v, "y", perm), lambda v: jax.lax.ppermute(v, "y", perm),
           local, dtype, seed)


@st.composite
def index_groups(draw):
  n = 4
  kind = draw(st.sampled_from(["pairs", "strided", "whole", "singletons", "uneven", "missing", "repeated"]))
  return {"pairs": [[0, 1], [2, 3]], "strided": [[0, 2], [1, 3]], "whole": [[3, 2, 1, 0]],
          "singletons": [[i] for i in range(n)], "uneven": [[0], [1, 2, 3]], "missing": [[0, 1]],
          "repeated": [[0, 0], [1, 2]]}[kind]


@SETTINGS
@given(arrays(), index_groups(), st.sampled_from(["psum", "pmax", "all_gather"]))
def test_axis_index_groups(arr, groups, op):
  local, dtype, seed = arr
  if op == "all_gather":
    ours = lambda v: dc.all_gather(v, "y", axis_index_groups=groups)
    ref = lambda v: jax.lax.all_gather(v, "y", axis_index_groups=groups)
  else:
    ours = lambda v: getattr(dc, op)(v, "y", axis_index_groups=groups)
    ref = lambda v: getattr(jax.lax, op)(v, "y", axis_index_groups=groups)
  _compare(f"{op}[groups]", ours, ref, local, dtype, seed)


@SETTINGS
@given(arrays(), st.sampled_from(["", "k", "ключ/λ", "x" * 500, None, 7]))
def test_keys(arr, key):
  local, dtype, seed = arr
  if key == "" or key == 7:
    with pytest.raises(TypeError, match="jax_dfccl: key must be a non-empty string"):
      _run(lambda v: dc.psum(v, "y", key=key), local, np.float32, seed)
    OUTCOMES[("key", "refused")] += 1
    return
  _compare("psum[key]", lambda v: dc.psum(v, "y", key=key), lambda v: jax.lax.psum(v, "y"), local, dtype, seed)


@SETTINGS
@given(arrays(), st.sampled_from(AXES[:4]))
def test_start_forms(arr, ax):
  local, dtype, seed = arr
  _compare("psum_start", lambda v: dc.done(dc.psum_start(v, ax)), lambda v: jax.lax.psum(v, ax), local, dtype,
           seed)


def test_zz_report():
  """The outcome counts (run last in this module)."""
  total = sum(OUTCOMES.values())
  print(f"\nproperty tests: {total} generated cases: " + ", ".join(f"{k[0]} {k[1]}: {v}" for k, v in
                                                             sorted(OUTCOMES.items())))
  assert total > 0
