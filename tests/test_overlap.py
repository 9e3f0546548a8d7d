"""Tests of the GEMM + communication overlap ops (jax_dfccl/_src/overlap.py).

References are jnp.dot + jax.lax collectives on float32 copies of the inputs.
CPU: needs 8 devices (tests/conftest.py sets
XLA_FLAGS=--xla_force_host_platform_device_count=8). GPU tests: ``pytest -m gpu``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_dfccl._src import overlap as ov

OPS = {  # name -> (op, x spec, w spec, out spec, jax.lax reference (per shard))
    "ag": (ov.all_gather_matmul, P("tp", None), P(None, "tp"), P(None, "tp"),
           lambda x, w: jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w),
    "rs": (ov.matmul_reduce_scatter, P(None, "tp"), P("tp", None), P("tp", None),
           lambda x, w: jax.lax.psum_scatter(x @ w, "tp", scatter_dimension=0, tiled=True)),
    "ar": (ov.matmul_psum, P(None, "tp"), P("tp", None), P(),
           lambda x, w: jax.lax.psum(x @ w, "tp")),
}
# Relative (to max |ref|) error bounds; f32 references, f32 accumulation in ours.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}
BACKENDS = ["lax", "dfccl"]


def _need(n):
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")


def _mesh(n, names=("tp",), shape=None):
  _need(n)
  shape = shape or (n,)
  return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def _shapes(rng, n, kind):
  """Global (M, K, N), none a multiple of 128; divisible by n where sharded
  (ag: M, N; rs: M, K; ar: K)."""
  m, k, c = (int(v) for v in rng.integers(1, 6, size=3))
  M = 3 * n * m if kind != "ar" else 3 * m + 1
  K = 8 * k + 5 if kind == "ag" else n * (k + 3)
  N = n * (c + 2) if kind == "ag" else 8 * c + 7
  return M, K, N


def _put(mesh, a, spec):
  return jax.device_put(a, NamedSharding(mesh, spec))


def _spec(a):
  """A partition spec padded to rank 2 (P('tp') == P('tp', None))."""
  spec = tuple(getattr(getattr(a, "sharding", None), "spec", a))
  return spec + (None,) * (2 - len(spec))


def _rel_err(got, ref):
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def _inputs(seed, mesh_n, kind, dtype):
  rng = np.random.default_rng(seed)
  M, K, N = _shapes(rng, mesh_n, kind)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
  return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


def _sm(mesh, kind, fn):
  _, xs, ws, os_, _ = OPS[kind]
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(xs, ws), out_specs=os_))


def _reference(mesh, kind, x, w):
  _, xs, ws, _, ref = OPS[kind]
  x32, w32 = (jnp.asarray(a, jnp.float32) for a in (x, w))
  return _sm(mesh, kind, ref)(_put(mesh, x32, xs), _put(mesh, w32, ws))


# ---------------------------------------------------------------------------
# Per-shard semantics inside shard_map


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("kind", list(OPS))
def test_per_shard_matches_lax(kind, n, dtype, backend):
  mesh = _mesh(n)
  op, xs, ws, _, _ = OPS[kind]
  x, w = _inputs(100 * n + len(kind), n, kind, dtype)
  with ov.collectives(backend):
    got = _sm(mesh, kind, lambda x, w: op(x, w, "tp"))(_put(mesh, x, xs), _put(mesh, w, ws))
  assert got.dtype == dtype
  ref = _reference(mesh, kind, x, w)
  assert got.shape == ref.shape
  assert _rel_err(got, ref) < TOL[dtype]


@pytest.mark.parametrize("num_chunks", [1, 3, 100])
def test_matmul_psum_chunks(num_chunks):
  mesh = _mesh(4)
  x, w = _inputs(7, 4, "ar", jnp.float32)
  got = _sm(mesh, "ar", lambda x, w: ov.matmul_psum(x, w, "tp", num_chunks=num_chunks))(
      _put(mesh, x, OPS["ar"][1]), _put(mesh, w, OPS["ar"][2]))
  assert _rel_err(got, _reference(mesh, "ar", x, w)) < 1e-5


def test_two_dimensional_mesh():
  """Overlap over 'tp' while the rows are also split over 'dp'."""
  mesh = _mesh(8, ("dp", "tp"), (2, 4))
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2 * 4 * 5, 24)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((24, 4 * 9)), jnp.float32)
  f = jax.jit(jax.shard_map(lambda x, w: ov.all_gather_matmul(x, w, "tp"), mesh=mesh,
                            in_specs=(P(("dp", "tp"), None), P(None, "tp")),
                            out_specs=P("dp", "tp")))
  got = f(_put(mesh, x, P(("dp", "tp"), None)), _put(mesh, w, P(None, "tp")))
  assert _rel_err(got, x @ w) < 1e-5


# ---------------------------------------------------------------------------
# Gradients


def _loss(f):
  return lambda x, w: jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", list(OPS))
def test_grad_per_shard(kind, n, backend):
  mesh = _mesh(n)
  op, xs, ws, _, ref = OPS[kind]
  x, w = _inputs(11 * n, n, kind, jnp.float32)
  args = (_put(mesh, x, xs), _put(mesh, w, ws))
  with ov.collectives(backend):
    ours = jax.jit(jax.grad(_loss(_sm(mesh, kind, lambda x, w: op(x, w, "tp"))), argnums=(0, 1)))(
        *args)
  want = jax.jit(jax.grad(_loss(_sm(mesh, kind, ref)), argnums=(0, 1)))(*args)
  for g, r in zip(ours, want):
    assert _rel_err(g, r) < 1e-5


def test_grad_uses_the_dual_op():
  """d all_gather_matmul / dx is a matmul_reduce_scatter (a ring of ppermutes,
  no all-gather/reduce-scatter collective), and vice versa."""
  mesh = _mesh(4)
  for kind in ("ag", "rs"):
    op, xs, ws, _, _ = OPS[kind]
    x, w = _inputs(5, 4, kind, jnp.float32)
    f = jax.grad(_loss(_sm(mesh, kind, lambda x, w: op(x, w, "tp"))), argnums=0)
    eqns = list(_all_eqns(jax.make_jaxpr(f)(_put(mesh, x, xs), _put(mesh, w, ws)).jaxpr))
    comms = {e.params.get("op", e.primitive.name) for e in eqns
             if e.primitive.name in ("ppermute", "all_gather", "reduce_scatter", "psum_scatter",
                                     "psum", "dfccl_start", "dfccl_collective")}
    assert comms == {"ppermute"}, comms


def test_grad_invariant_weight():
  """A replicated (invariant) w gets its cotangent summed over the axis."""
  mesh = _mesh(4)
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((4 * 3, 10)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((10, 6)), jnp.float32)

  def grads(body):
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"))
    return jax.jit(jax.grad(_loss(f), argnums=(0, 1)))(_put(mesh, x, P("tp")), _put(mesh, w, P()))

  ours = grads(lambda x, w: ov.all_gather_matmul(x, w, "tp"))
  want = grads(lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w)
  for g, r in zip(ours, want):
    assert _rel_err(g, r) < 1e-5


# ---------------------------------------------------------------------------
# vmap


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(OPS))
def test_vmap(kind, backend):
  mesh = _mesh(4)
  op, xs, ws, os_, ref = OPS[kind]
  x, w = _inputs(21, 4, kind, jnp.float32)
  xb = jnp.stack([x, 2 * x, -x])
  bx, bo = P(None, *xs), P(None, *os_)

  def run(fn):
    f = jax.shard_map(jax.vmap(fn, in_axes=(0, None)), mesh=mesh, in_specs=(bx, ws), out_specs=bo)
    return jax.jit(f)(_put(mesh, xb, bx), _put(mesh, w, ws))

  with ov.collectives(backend):
    got = run(lambda x, w: op(x, w, "tp"))
  assert _rel_err(got, run(ref)) < 1e-5


# ---------------------------------------------------------------------------
# Global arrays from plain jax.jit (custom_partitioning + Shardy rule)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("kind", list(OPS))
def test_sharded_jit(kind, n, axis_type, backend):
  _need(n)
  mesh = jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n],
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  op, xs, ws, os_, _ = OPS[kind]
  x, w = _inputs(31 * n, n, kind, jnp.bfloat16)
  f = jax.jit(lambda x, w: op(x, w, "tp"))
  args = (_put(mesh, x, xs), _put(mesh, w, ws))
  with ov.collectives(backend):
    got = f(*args)
    hlo = f.lower(*args).compile().as_text()
  assert got.dtype == jnp.bfloat16
  assert _spec(got) == _spec(os_)
  ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  assert _rel_err(got, ref) < TOL[jnp.bfloat16]
  # The partitioned program is our ring (or chunked psums), not XLA's collective.
  if kind != "ar":
    assert "collective-permute" in hlo or "dfccl" in hlo
    assert "all-gather(" not in hlo and "reduce-scatter(" not in hlo


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(OPS))
def test_sharded_jit_grad(kind, backend):
  mesh = _mesh(4)
  op, xs, ws, _, _ = OPS[kind]
  x, w = _inputs(41, 4, kind, jnp.float32)
  with ov.collectives(backend):
    ours = jax.jit(jax.grad(_loss(lambda x, w: op(x, w, "tp")), argnums=(0, 1)))(
        _put(mesh, x, xs), _put(mesh, w, ws))
  want = jax.grad(_loss(jnp.dot), argnums=(0, 1))(x, w)
  for g, r, spec in zip(ours, want, (xs, ws)):
    assert _rel_err(g, r) < 1e-5
    assert _spec(g) == _spec(spec)


def test_sharded_jit_set_mesh_and_resharding():
  """Mesh from jax.set_mesh; inputs sharded otherwise are resharded."""
  mesh = _mesh(4)
  x, w = _inputs(51, 4, "rs", jnp.float32)
  with jax.set_mesh(mesh):
    got = jax.jit(lambda x, w: ov.matmul_reduce_scatter(x, w, "tp"))(
        _put(mesh, x, P("tp", None)), _put(mesh, w, P()))
  assert _rel_err(got, x @ w) < 1e-5


# ---------------------------------------------------------------------------
# Schedule: tail-free order


def _all_eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for sub in jax.core.jaxprs_in_params(e.params) if hasattr(jax.core, "jaxprs_in_params") \
        else _subjaxprs(e.params):
      yield from _all_eqns(sub)


def _subjaxprs(params):
  for v in params.values():
    vs = v if isinstance(v, (tuple, list)) else (v,)
    for j in vs:
      if hasattr(j, "eqns"):
        yield j
      elif hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
        yield j.jaxpr


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("n", [2, 4])
def test_tail_free_order(kind, n, backend):
  """No communication after the last GEMM; AG+GEMM's first GEMM is the local shard;
  with start/done collectives each GEMM sits between a start and its done."""
  mesh = _mesh(n)
  op, xs, ws, _, _ = OPS[kind]
  x, w = _inputs(61, n, kind, jnp.float32)
  with ov.collectives(backend):
    jaxpr = jax.make_jaxpr(_sm(mesh, kind, lambda x, w: op(x, w, "tp")))(
        _put(mesh, x, xs), _put(mesh, w, ws))
  eqns = list(_all_eqns(jaxpr.jaxpr))
  names = [e.primitive.name for e in eqns]
  dots = [i for i, p in enumerate(names) if p == "dot_general"]
  sends = [i for i, p in enumerate(names) if p in ("ppermute", "dfccl_start")]
  assert len(dots) == n and len(sends) == n - 1
  assert max(sends) < max(dots)                       # nothing is sent after the last GEMM
  if backend == "dfccl":  # transfer i is in flight during one GEMM: start < GEMM < done
    ends = [i for i, p in enumerate(names) if p == "dfccl_done"]
    overlapped = dots if kind == "ag" else dots[1:]
    assert all(s < d < e for s, d, e in zip(sends, overlapped, ends))
  if kind == "ag":  # local shard first: the first GEMM does not wait for a transfer
    received = {v for e in eqns if e.primitive.name in ("ppermute", "dfccl_done")
                for v in e.outvars}
    assert eqns[dots[0]].invars[0] not in received


# ---------------------------------------------------------------------------
# Trace-time errors


@pytest.mark.parametrize("args, exc, msg", [
    ((np.ones((4,), np.float32), np.ones((4, 2), np.float32)), ValueError, "rank 2"),
    ((np.ones((4, 3), np.float32), np.ones((3, 2), jnp.bfloat16)), TypeError, "one dtype"),
    ((np.ones((4, 3), np.int32), np.ones((3, 2), np.int32)), TypeError, "unsupported dtype"),
    ((np.ones((4, 3), np.float32), np.ones((5, 2), np.float32)), ValueError, "contraction"),
])
def test_errors(args, exc, msg):
  for op in (ov.all_gather_matmul, ov.matmul_reduce_scatter, ov.matmul_psum):
    with pytest.raises(exc, match=msg):
      op(*args, "tp")


def test_errors_axis_and_divisibility():
  with pytest.raises(NameError, match="neither a shard_map axis"):
    jax.jit(lambda x, w: ov.all_gather_matmul(x, w, "tp"))(jnp.ones((4, 3)), jnp.ones((3, 2)))
  mesh = _mesh(4)
  with pytest.raises(ValueError, match="not divisible"):
    jax.jit(lambda x, w: ov.matmul_reduce_scatter(x, w, "tp"))(
        _put(mesh, jnp.ones((6, 8)), P(None, "tp")), _put(mesh, jnp.ones((8, 4)), P("tp", None)))
  f = jax.shard_map(lambda x, w: ov.matmul_reduce_scatter(x, w, "tp"), mesh=mesh,
                    in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
  with pytest.raises(ValueError, match="not divisible"):
    jax.jit(f)(_put(mesh, jnp.ones((6, 8)), P(None, "tp")), _put(mesh, jnp.ones((8, 4)), P("tp")))


# ---------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["lax", "dfccl"])
@pytest.mark.parametrize("kind", list(OPS))
def test_gpu_bf16(kind, backend):
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if len(gpus) < 2:
    pytest.skip("needs 2 GPUs")
  mesh = jax.make_mesh((2,), ("tp",), devices=gpus[:2])
  op, xs, ws, _, _ = OPS[kind]
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1000, 1536)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((1536, 2050)) / 40, jnp.bfloat16)
  with ov.collectives(backend):
    got = jax.jit(functools.partial(op, axis_name="tp"))(_put(mesh, x, xs), _put(mesh, w, ws))
  ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  assert _rel_err(got, ref) < TOL[jnp.bfloat16]


def test_bf16_matmul_reduce_scatter_partials_in_f32():
  """The ring's partial sums travel in float32: against float64, bf16 GEMM+RS on 8 ranks
  is no worse than jax.lax's psum_scatter(x @ w) and about one bf16 rounding off."""
  n = 8
  mesh = _mesh(n)
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((8 * n, 64 * n)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64 * n, 48)), jnp.bfloat16)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)

  def run(fn):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
    return np.asarray(f(_put(mesh, x, P(None, "tp")), _put(mesh, w, P("tp", None))), np.float64)
  ours = run(lambda a, b: ov.matmul_reduce_scatter(a, b, "tp"))
  lax_ = run(lambda a, b: jax.lax.psum_scatter(
      jax.lax.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype), "tp", tiled=True))
  err = lambda y: float(np.abs(y - ref).max() / np.abs(ref).max())  # noqa: E731
  assert err(ours) <= err(lax_) + 1e-9
  assert err(ours) < 2 ** -8  # one rounding to bf16 (relative 2^-9 of the largest entry)
