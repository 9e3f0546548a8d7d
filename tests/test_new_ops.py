"""pbroadcast and ragged_all_to_all (the op table's broadcast and
ragged_all_to_all rows) on the CPU backend.

jax.lax.pbroadcast has no CPU lowering: the reference is its documented
definition, psum(where(axis_index == source, x, 0)).  jax.lax.ragged_all_to_all
is not implemented by XLA:CPU: the reference is numpy, following jax.lax's
documented semantics."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import cpu_mesh, put

MESHES = [((8,), ("x",), "x"), ((2, 4), ("x", "y"), "y"), ((2, 4), ("x", "y"), ("x", "y"))]


def _shmap(mesh, f, n_in=1, check_vma=True):
  spec = P(mesh.axis_names)
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * n_in, out_specs=spec, check_vma=check_vma))


def _reference_broadcast(ax, source):
  def f(x):
    return jax.lax.psum(jnp.where(jax.lax.axis_index(ax) == source, x, jnp.zeros_like(x)), ax)
  return f


@pytest.mark.parametrize("mesh_shape,names,ax", MESHES)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32, np.int8, np.complex64])
def test_pbroadcast_matches_definition(mesh_shape, names, ax, dtype):
  mesh = cpu_mesh(mesh_shape, names)
  n = int(np.prod([mesh.shape[a] for a in (ax if isinstance(ax, tuple) else (ax,))]))
  rng = np.random.default_rng(1)
  x = put(jnp.asarray(rng.integers(-50, 50, size=(8 * 2, 3)).astype(dtype)), mesh, P(names))
  for source in (0, n - 1):
    got = _shmap(mesh, lambda v: dc.pbroadcast(v, ax, source)[None])(x)
    want = _shmap(mesh, lambda v: _reference_broadcast(ax, source)(v)[None])(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # data movement: bit-exact


def test_pbroadcast_bool_bits(mesh8):
  x = put(jnp.asarray(np.random.default_rng(0).integers(0, 2, size=(8, 5)).astype(bool)), mesh8, P("x"))
  got = np.asarray(_shmap(mesh8, lambda v: dc.pbroadcast(v, "x", 5))(x))
  np.testing.assert_array_equal(got, np.tile(np.asarray(x)[5:6], (8, 1)))


def test_pbroadcast_start_pytree_and_grad(mesh8):
  x = put(jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4), mesh8, P("x"))

  def f(v):
    h = dc.pbroadcast_start({"a": v, "b": v * 2}, "x", 2)
    r = dc.done(h)
    return r["a"] + r["b"]
  got = np.asarray(_shmap(mesh8, f)(x))
  np.testing.assert_array_equal(got, np.tile(3 * np.asarray(x)[2:3], (8, 1)))

  w = jnp.arange(1.0, 5.0)
  loss = lambda lib: lambda v: jnp.sum(jax.shard_map(
      lambda b: (lib(b) * w) ** 2, mesh=mesh8, in_specs=P("x"), out_specs=P("x"))(v))
  g = jax.jit(jax.grad(loss(lambda b: dc.pbroadcast(b, "x", 6))))(x)
  g_ref = jax.jit(jax.grad(loss(_reference_broadcast("x", 6))))(x)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-6)
  assert np.count_nonzero(np.asarray(g)[:6]) == 0 and np.count_nonzero(np.asarray(g)[7:]) == 0


def test_pbroadcast_errors(mesh8):
  x = put(jnp.zeros((8, 2)), mesh8, P("x"))
  with pytest.raises(ValueError, match="pbroadcast: source 8 is outside"):
    _shmap(mesh8, lambda v: dc.pbroadcast(v, "x", 8))(x)
  with pytest.raises(TypeError, match="pbroadcast: source must be a Python int"):
    _shmap(mesh8, lambda v: dc.pbroadcast(v, "x", jnp.int32(1)))(x)


def test_patch_lax_pbroadcast(mesh8):
  x = put(jnp.arange(16.0).reshape(8, 2), mesh8, P("x"))
  with dc.patch_lax():
    f = _shmap(mesh8, lambda v: jax.lax.pbroadcast(v, "x", 4))
    hlo = f.lower(x).as_text()
    got = f(x)
  assert "dfccl_start" in hlo
  np.testing.assert_array_equal(np.asarray(got), np.tile(np.asarray(x)[4:5], (8, 1)))


# ---- ragged_all_to_all ---------------------------------------------------------


def _ragged_case(n, k, rows_in, rows_out, row_shape, dtype, seed):
  """Per rank: operand, output, and valid offsets/sizes (numpy), with
  send_sizes == all_to_all(recv_sizes) and disjoint destination ranges."""
  rng = np.random.default_rng(seed)
  K = n * k
  send = rng.integers(0, 3, size=(n, K))  # send[r, i]: rank r's slice i (to rank i // k)
  recv = np.zeros((n, K), np.int64)  # recv[d, s*k + j] = send[s, d*k + j]
  out_off = np.zeros((n, K), np.int64)
  for d in range(n):
    pos = 0
    for s in range(n):
      for j in range(k):
        size = send[s, d * k + j]
        recv[d, s * k + j] = size
        out_off[s, d * k + j] = pos
        pos += size + rng.integers(0, 2)  # some padding between slices
    assert pos <= rows_out
  in_off = np.zeros((n, K), np.int64)
  for r in range(n):
    pos = 0
    for i in range(K):
      in_off[r, i] = pos
      pos += send[r, i]
    assert pos <= rows_in
  operand = rng.integers(-100, 100, size=(n, rows_in) + row_shape).astype(dtype)
  output = rng.integers(-100, 100, size=(n, rows_out) + row_shape).astype(dtype)
  return operand, output, in_off, send, out_off, recv


def _ragged_reference(operand, output, in_off, send, out_off, recv, k):
  n = operand.shape[0]
  res = output.copy()
  for s in range(n):
    for i in range(n * k):
      d = i // k
      res[d, out_off[s, i]:out_off[s, i] + send[s, i]] = operand[s, in_off[s, i]:in_off[s, i] + send[s, i]]
  return res


def _ragged_fn(mesh, ax, start=False):
  def body(a, b, c, d, e, f):
    args = (a[0], b[0], c[0].astype(jnp.int32), d[0].astype(jnp.int32), e[0].astype(jnp.int32),
            f[0].astype(jnp.int32))
    if start:
      return dc.done(dc.ragged_all_to_all_start(*args, axis_name=ax))[None]
    return dc.ragged_all_to_all(*args, axis_name=ax)[None]
  return _shmap(mesh, body, n_in=6)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype,row_shape", [(np.float32, (3,)), (jnp.bfloat16, (2, 5)), (np.int8, (3,)),
                                             (np.int32, ())])
@pytest.mark.parametrize("start", [False, True])
def test_ragged_all_to_all_matches_numpy(k, dtype, row_shape, start):
  n = 8
  mesh = cpu_mesh((n,), ("x",))
  case = _ragged_case(n, k, rows_in=6 * k * n // 2 + 4, rows_out=5 * n * k, row_shape=row_shape, dtype=dtype,
                      seed=k)
  want = _ragged_reference(*case, k)
  got = _ragged_fn(mesh, "x", start)(*[put(jnp.asarray(v), mesh, P("x")) for v in case])
  np.testing.assert_array_equal(np.asarray(got), want)  # data movement: bit-exact


def test_ragged_all_to_all_sub_axis():
  mesh = cpu_mesh((2, 4), ("x", "y"))
  case = _ragged_case(4, 1, rows_in=12, rows_out=16, row_shape=(2,), dtype=np.float32, seed=3)
  case2 = _ragged_case(4, 1, rows_in=12, rows_out=16, row_shape=(2,), dtype=np.float32, seed=4)
  both = [np.concatenate([a, b]) for a, b in zip(case, case2)]  # x=0: case, x=1: case2
  want = np.concatenate([_ragged_reference(*case, 1), _ragged_reference(*case2, 1)])
  got = _ragged_fn(mesh, "y")(*[put(jnp.asarray(v), mesh, P(("x", "y"))) for v in both])
  np.testing.assert_array_equal(np.asarray(got), want)


def test_ragged_all_to_all_group_of_one():
  mesh = cpu_mesh((8, 1), ("x", "y"))
  case = _ragged_case(1, 2, rows_in=8, rows_out=10, row_shape=(3,), dtype=np.float32, seed=5)
  both = [np.concatenate([v] * 8) for v in case]
  want = np.concatenate([_ragged_reference(*case, 2)] * 8)
  f = _ragged_fn(mesh, "y")
  args = [put(jnp.asarray(v), mesh, P(("x", "y"))) for v in both]
  assert "dfccl_start" not in f.lower(*args).as_text()  # no runtime for a group of one
  np.testing.assert_array_equal(np.asarray(f(*args)), want)


def test_ragged_all_to_all_grad():
  n, k = 4, 1
  mesh = cpu_mesh((n,), ("x",))
  operand, output, in_off, send, out_off, recv = _ragged_case(n, k, 10, 16, (2,), np.float32, seed=6)
  w = np.random.default_rng(7).normal(size=output.shape).astype(np.float32)
  idx = [put(jnp.asarray(v), mesh, P("x")) for v in (in_off, send, out_off, recv)]

  def loss(op_, out_):
    def body(a, b, c, d, e, f, wv):
      y = dc.ragged_all_to_all(a[0], b[0], c[0].astype(jnp.int32), d[0].astype(jnp.int32),
                               e[0].astype(jnp.int32), f[0].astype(jnp.int32), axis_name="x")
      return jnp.sum(y * wv[0])[None]
    spec = P("x")
    return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 7, out_specs=spec)(
        op_, out_, *idx, put(jnp.asarray(w), mesh, spec)))
  g_op, g_out = jax.jit(jax.grad(loss, argnums=(0, 1)))(put(jnp.asarray(operand), mesh, P("x")),
                                                       put(jnp.asarray(output), mesh, P("x")))
  # numpy: d loss / d operand[s, row] = w at where that row lands; d / d output = w outside received rows.
  want_op = np.zeros_like(operand)
  want_out = w.copy()
  for s in range(n):
    for i in range(n * k):
      d = i // k
      want_op[s, in_off[s, i]:in_off[s, i] + send[s, i]] = w[d, out_off[s, i]:out_off[s, i] + send[s, i]]
      want_out[d, out_off[s, i]:out_off[s, i] + send[s, i]] = 0
  np.testing.assert_array_equal(np.asarray(g_op), want_op)
  np.testing.assert_array_equal(np.asarray(g_out), want_out)


def test_ragged_all_to_all_recv_size_mismatch_names_key_and_ranks():
  n = 4
  mesh = cpu_mesh((n,), ("x",))
  case = list(_ragged_case(n, 1, 10, 16, (2,), np.float32, seed=8))
  case[5] = case[5].copy()
  case[5][2, 1] += 1  # rank 2 expects one row more from rank 1 than rank 1 sends
  f = _shmap(mesh, lambda a, b, c, d, e, f_: dc.ragged_all_to_all(
      a[0], b[0], c[0].astype(jnp.int32), d[0].astype(jnp.int32), e[0].astype(jnp.int32),
      f_[0].astype(jnp.int32), axis_name="x", key="moe/dispatch")[None], n_in=6)
  with pytest.raises(Exception, match=r"moe/dispatch.*rank 1 sends .* rows to rank 2"):
    jax.block_until_ready(f(*[put(jnp.asarray(v), mesh, P("x")) for v in case]))
  # The runtime is usable afterwards.
  good = _ragged_case(n, 1, 10, 16, (2,), np.float32, seed=9)
  got = f(*[put(jnp.asarray(v), mesh, P("x")) for v in good])
  np.testing.assert_array_equal(np.asarray(got), _ragged_reference(*good, 1))


def test_ragged_all_to_all_trace_errors(mesh8):
  x = put(jnp.zeros((8, 4)), mesh8, P("x"))
  i8 = put(jnp.zeros((8 * 8,), jnp.int32), mesh8, P("x"))
  i6 = put(jnp.zeros((8 * 6,), jnp.int32), mesh8, P("x"))
  f = lambda off: _shmap(mesh8, lambda a, o: dc.ragged_all_to_all(a, a, o, o, o, o, axis_name="x"), n_in=2)(x, off)
  with pytest.raises(ValueError, match="not a multiple of the group size 8"):
    f(i6)
  with pytest.raises(TypeError, match="dtypes differ"):
    _shmap(mesh8, lambda a, o: dc.ragged_all_to_all(a, a.astype(jnp.int32), o, o, o, o, axis_name="x"),
           n_in=2)(x, i8)
