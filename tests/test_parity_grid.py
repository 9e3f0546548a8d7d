"""Parity of every public collective with jax.lax, as a grid: op x transform.

Each row of OPS is one public op called the way a program calls it inside
``jax.shard_map`` over a (2, 4) mesh, next to the jax.lax program it replaces
(the reference).  Each transform of TRANSFORMS (the plain value, ``vmap`` over a
batch, ``vmap`` over a named axis the op communicates over, ``jax.jvp``,
``jax.linearize``, ``jax.grad``, ``jax.grad`` of ``jax.checkpoint``) is applied to
both programs on the same inputs: results agree within numpy tolerances, or both
raise, with the same exception type.

Where jax.lax cannot run the op on CPU (``pbroadcast`` has no CPU lowering, XLA:CPU
has no ``ragged_all_to_all``) the reference is its definition written with
jax.lax's all_gather/psum (differentiable and batchable like the op), and jax.lax's
own op is still traced next to ours wherever tracing decides (named-axis vmap,
residuals under checkpoint, argument errors).  Where jax.lax has no rule (the JVP
of ``pmax``/``pmin``) the grid asserts that jax.lax raises and checks ours against
the rule written with jax.lax (the tangent of the winning ranks, averaged over
ties).  The start forms (``*_start`` + ``done``) are checked against the blocking
jax.lax op; their handles are not differentiable (NotImplementedError, asserted).

ERRORS: bad arguments, called on both libraries; the exception types must be equal
(including which of two faults is reported first).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import cpu_mesh, put

N_X, N_Y = 2, 4  # the mesh; the ops communicate over "y" (size 4)
SHAPE = (8, 8)  # global input; (4, 2) per shard under P("x", "y")
B = 3  # vmap batch size


# ---------------------------------------------------------------- ragged_all_to_all inputs

# Rank r of "y" sends SEND[r, d] rows to rank d (one slice per destination), packed from row 0 of
# its operand; they land on d packed in source order from row 0 (rows 3 of rank 0 are untouched).
def _tables(send):
  """(input_offsets, send_sizes, output_offsets, recv_sizes) per rank for slices packed from row 0."""
  in_off = np.concatenate([np.zeros((N_Y, 1)), np.cumsum(send, 1)[:, :-1]], 1)
  out_off = np.concatenate([np.zeros((1, N_Y)), np.cumsum(send, 0)[:-1]], 0)
  return tuple(np.asarray(t, np.int32) for t in (in_off, send, out_off, send.T))


SEND = np.array([[1, 0, 2, 0], [0, 1, 0, 1], [1, 0, 1, 0], [1, 1, 0, 1]], np.int32)
TABLES = _tables(SEND)
TABLES_2 = _tables(SEND[::-1, ::-1].copy())  # another valid exchange (a second vmap element)


def _ragged_args(v):
  """The operand, an output of the same rows (values that only unreceived rows keep), and this
  rank's offsets and sizes (varying with its index along "y")."""
  r = lax.axis_index("y")
  idx = [jnp.asarray(t)[r] for t in TABLES]
  return v, jnp.cos(v)[::-1] * 3.0, *idx


def ragged_reference(operand, output, in_off, send, out_off, recv, *, axis_name):
  """jax.lax.ragged_all_to_all's documented semantics with jax.lax.all_gather (differentiable in
  operand and output, batchable): this rank's output rows [o, o + size) take the rows
  [i, i + size) of the operand of every rank that sends it a slice."""
  del recv
  n = lax.axis_size(axis_name)
  k = in_off.shape[0] // n
  ops, io, ss, oo = (lax.all_gather(t, axis_name) for t in (operand, in_off, send, out_off))
  me = lax.axis_index(axis_name)
  rows = jnp.arange(output.shape[0])
  out = output
  for s in range(n):
    for j in range(k):
      i = me * k + j
      lo, size = oo[s][i], ss[s][i]
      inside = ((rows >= lo) & (rows < lo + size)).reshape((-1,) + (1,) * (output.ndim - 1))
      src = jnp.clip(io[s][i] + rows - lo, 0, operand.shape[0] - 1)
      out = jnp.where(inside, ops[s][src], out)
  return out


def _pbroadcast_reference(v, ax, source):  # jax.lax.pbroadcast's documented definition
  return lax.psum(jnp.where(lax.axis_index(ax) == source, v, jnp.zeros_like(v)), ax)


def _pextreme_reference(red):
  """pmax/pmin with the derivative jax.lax does not define: the tangent of the winning ranks,
  averaged over ties (the value is red(v); the derivative term is zero in value)."""
  def f(v, ax):
    sv = lax.stop_gradient(v)
    y = red(sv, ax)
    win = (sv == y).astype(v.dtype)
    return y + lax.psum(win * (v - sv), ax) / lax.psum(win, ax)
  return f


# ---------------------------------------------------------------- the ops


@dataclasses.dataclass(frozen=True)
class Op:
  name: str
  ours: Callable  # (v, axis_name) -> result, with jax_dfccl
  lax_op: Callable  # the same with jax.lax (None: no jax.lax op of this form)
  reference: Callable | None = None  # runs where lax_op does not (its definition)
  lax_raises: tuple = ()  # transforms jax.lax fails on (asserted), ours checked against `reference`
  refuses: tuple = ()  # transforms ours refuses by design (NotImplementedError, asserted)
  gaps: tuple = ()  # transforms ours does not support yet (strict xfail: passes once supported)

  def ref(self):
    return self.reference or self.lax_op


def _ring(ax_size):
  return [(i, (i + 1) % ax_size) for i in range(ax_size)]


def _ppermute(lib):
  return lambda v, ax: lib.ppermute(v, ax, _ring(lax.axis_size(ax)))


def _ragged(fn):
  return lambda v, ax: fn(*_ragged_args(v), axis_name=ax)


W_AG = np.random.default_rng(11).standard_normal((2, 3)).astype(np.float32)
W_RS = np.random.default_rng(12).standard_normal((2, 8)).astype(np.float32)
AD = ("jvp", "linearize", "grad", "checkpoint")
# The start forms: handles are not differentiable, and they take no vmapped axis name.
START_REFUSES = ("vmap_named_axis", *AD)
REFUSALS = {  # transform -> what ours says
    "vmap": "vmap of ragged_all_to_all is not supported",
    "vmap_named_axis": "start forms do not take a vmapped axis name",
    **{t: "start/done handles are not differentiable" for t in AD},
}

OPS = [
    Op("psum", lambda v, ax: dc.psum(v, ax), lambda v, ax: lax.psum(v, ax)),
    Op("pmean", lambda v, ax: dc.pmean(v, ax), lambda v, ax: lax.pmean(v, ax)),
    Op("pmax", lambda v, ax: dc.pmax(v, ax), lambda v, ax: lax.pmax(v, ax),
       reference=_pextreme_reference(lax.pmax), lax_raises=AD),
    Op("pmin", lambda v, ax: dc.pmin(v, ax), lambda v, ax: lax.pmin(v, ax),
       reference=_pextreme_reference(lax.pmin), lax_raises=AD),
    Op("all_gather", lambda v, ax: dc.all_gather(v, ax), lambda v, ax: lax.all_gather(v, ax)),
    Op("all_gather_tiled_ax1", lambda v, ax: dc.all_gather(v, ax, axis=1, tiled=True),
       lambda v, ax: lax.all_gather(v, ax, axis=1, tiled=True)),
    Op("psum_scatter", lambda v, ax: dc.psum_scatter(v, ax, tiled=True),
       lambda v, ax: lax.psum_scatter(v, ax, tiled=True)),
    Op("psum_scatter_untiled", lambda v, ax: dc.psum_scatter(v[: lax.axis_size(ax)], ax),
       lambda v, ax: lax.psum_scatter(v[: lax.axis_size(ax)], ax)),
    Op("all_to_all", lambda v, ax: dc.all_to_all(v, ax, 0, 1, tiled=True),
       lambda v, ax: lax.all_to_all(v, ax, 0, 1, tiled=True)),
    # jax.lax's transpose of an untiled all_to_all whose concat_axis differs from split_axis fails
    # ("Expected cotangent type float32[4,2,1] but got float32[4,1,2]"); the reference is the
    # same exchange written as a tiled one.
    Op("all_to_all_untiled", lambda v, ax: dc.all_to_all(v[: lax.axis_size(ax)], ax, 0, 1),
       lambda v, ax: lax.all_to_all(v[: lax.axis_size(ax)], ax, 0, 1),
       reference=lambda v, ax: jnp.moveaxis(lax.all_to_all(v[: lax.axis_size(ax)], ax, 0, 0, tiled=True), 0, 1),
       lax_raises=("grad", "checkpoint")),
    Op("ppermute", _ppermute(dc), _ppermute(lax)),
    Op("pbroadcast", lambda v, ax: dc.pbroadcast(v, ax, 1), lambda v, ax: lax.pbroadcast(v, ax, 1),
       reference=lambda v, ax: _pbroadcast_reference(v, ax, 1)),
    Op("ragged_all_to_all", _ragged(dc.ragged_all_to_all), _ragged(lax.ragged_all_to_all),
       reference=_ragged(ragged_reference)),
    # GEMM + communication overlap: against the jax.lax compositions they replace
    # (custom VJPs: no forward mode yet)
    Op("all_gather_matmul", lambda v, ax: dc.all_gather_matmul(v, W_AG, ax),
       lambda v, ax: lax.all_gather(v, ax, axis=0, tiled=True) @ W_AG, gaps=("jvp", "linearize")),
    Op("matmul_reduce_scatter", lambda v, ax: dc.matmul_reduce_scatter(v, W_RS, ax),
       lambda v, ax: lax.psum_scatter(v @ W_RS, ax, scatter_dimension=0, tiled=True), gaps=("jvp", "linearize")),
    Op("matmul_psum", lambda v, ax: dc.matmul_psum(v, W_RS, ax), lambda v, ax: lax.psum(v @ W_RS, ax),
       gaps=("jvp", "linearize")),
    # start forms: against the blocking jax.lax op
    Op("psum_start", lambda v, ax: dc.done(dc.psum_start(v, ax)), lambda v, ax: lax.psum(v, ax), refuses=START_REFUSES),
    Op("pmean_start", lambda v, ax: dc.done(dc.pmean_start(v, ax)), lambda v, ax: lax.pmean(v, ax),
       refuses=START_REFUSES),
    Op("pmax_start", lambda v, ax: dc.done(dc.pmax_start(v, ax)), lambda v, ax: lax.pmax(v, ax), refuses=START_REFUSES),
    Op("pmin_start", lambda v, ax: dc.done(dc.pmin_start(v, ax)), lambda v, ax: lax.pmin(v, ax), refuses=START_REFUSES),
    Op("all_gather_start", lambda v, ax: dc.done(dc.all_gather_start(v, ax, tiled=True)),
       lambda v, ax: lax.all_gather(v, ax, tiled=True), refuses=START_REFUSES),
    Op("psum_scatter_start", lambda v, ax: dc.done(dc.psum_scatter_start(v, ax, tiled=True)),
       lambda v, ax: lax.psum_scatter(v, ax, tiled=True), refuses=START_REFUSES),
    Op("all_to_all_start", lambda v, ax: dc.done(dc.all_to_all_start(v, ax, 0, 1, tiled=True)),
       lambda v, ax: lax.all_to_all(v, ax, 0, 1, tiled=True), refuses=START_REFUSES),
    Op("ppermute_start", lambda v, ax: dc.done(dc.ppermute_start(v, ax, _ring(lax.axis_size(ax)))),
       _ppermute(lax), refuses=START_REFUSES),
    Op("pbroadcast_start", lambda v, ax: dc.done(dc.pbroadcast_start(v, ax, 1)),
       lambda v, ax: lax.pbroadcast(v, ax, 1), reference=lambda v, ax: _pbroadcast_reference(v, ax, 1),
       refuses=START_REFUSES),
    Op("ragged_all_to_all_start", _ragged(lambda *a, **k: dc.done(dc.ragged_all_to_all_start(*a, **k))),
       _ragged(lax.ragged_all_to_all), reference=_ragged(ragged_reference), refuses=("vmap", *START_REFUSES)),
]
OPS_BY_NAME = {op.name: op for op in OPS}


# ---------------------------------------------------------------- programs and transforms


@pytest.fixture(scope="module")
def mesh():
  return cpu_mesh((N_X, N_Y), ("x", "y"))


_CHECK_VMA = [False]  # the programs' check_vma (test_grid runs both)


def _program(fn, mesh, ax="y"):
  """fn over axis `ax` in a shard_map over the whole mesh; per-shard results stacked along a
  leading axis of the global result, so every op's shape fits one out_spec."""
  return jax.shard_map(lambda v: fn(v, ax)[None], mesh=mesh, in_specs=P("x", "y"),
                       out_specs=P(("x", "y")), check_vma=_CHECK_VMA[0])


def _inputs(mesh, seed=0, batch=False, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  shape = ((B,) if batch else ()) + SHAPE
  spec = P(None, "x", "y") if batch else P("x", "y")
  v = rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if dtype == jnp.complex64 else 0)
  return put(jnp.asarray(v, dtype), mesh, spec)


def _weights(out_shape, seed=7):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(out_shape), jnp.float32)


def _loss(g, w):
  return lambda v: jnp.sum(jnp.sin(g(v)) * w)


def t_value(fn, mesh):
  return jax.jit(_program(fn, mesh))(_inputs(mesh))


def t_vmap(fn, mesh):
  return jax.jit(jax.vmap(_program(fn, mesh)))(_inputs(mesh, batch=True))


def t_vmap_named_axis(fn, mesh):
  """The op over a vmapped axis name "b" (inside the shard_map; no device communicates)."""
  def per_shard(v):
    vb = jnp.stack([v, 2.0 * v + 1.0, -v])  # (3, 4, 2)
    return jax.vmap(lambda u: fn(u, "b"), axis_name="b")(vb)[None]
  sm = jax.shard_map(per_shard, mesh=mesh, in_specs=P("x", "y"), out_specs=P(("x", "y")),
                     check_vma=_CHECK_VMA[0])
  return jax.jit(sm)(_inputs(mesh))


def t_jvp(fn, mesh):
  g = _program(fn, mesh)
  return jax.jit(lambda x, t: jax.jvp(g, (x,), (t,)))(_inputs(mesh), _inputs(mesh, seed=1))


def t_linearize(fn, mesh):
  g = _program(fn, mesh)
  x, t = _inputs(mesh), _inputs(mesh, seed=1)
  y, f_jvp = jax.linearize(g, x)
  return y, jax.jit(f_jvp)(t), f_jvp(2.0 * t)


def t_grad(fn, mesh):
  g = _program(fn, mesh)
  x = _inputs(mesh)
  w = _weights(jax.eval_shape(g, x).shape)
  return jax.jit(jax.grad(_loss(g, w)))(x)


def t_checkpoint(fn, mesh):
  g = jax.checkpoint(_program(fn, mesh))
  x = _inputs(mesh)
  w = _weights(jax.eval_shape(g, x).shape)
  return jax.jit(jax.grad(_loss(g, w)))(x)


TRANSFORMS = {"value": t_value, "vmap": t_vmap, "vmap_named_axis": t_vmap_named_axis, "jvp": t_jvp,
              "linearize": t_linearize, "grad": t_grad, "checkpoint": t_checkpoint}


def _outcome(f, *args):
  try:
    return jax.tree.map(np.asarray, f(*args)), None
  except Exception as e:  # noqa: BLE001 -- the grid compares exception types
    return None, e


def _assert_same(got, want, what):
  (a, ea), (b, eb) = got, want
  if ea is not None or eb is not None:
    assert ea is not None and eb is not None, f"{what}: ours {ea!r}, reference {eb!r}"
    assert type(ea) is type(eb), f"{what}: ours {type(ea).__name__}: {ea}, reference {type(eb).__name__}: {eb}"
    return
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5, err_msg=what)


def _grid():
  for op in OPS:
    for t in TRANSFORMS:
      gap = pytest.mark.xfail(strict=True, reason=f"{op.name}: no {t} rule yet")
      yield pytest.param(op.name, t, id=f"{op.name}-{t}", marks=gap if t in op.gaps else ())


@pytest.fixture(params=[False, True], ids=["", "check_vma"])
def check_vma(request):
  _CHECK_VMA[0] = request.param
  yield request.param
  _CHECK_VMA[0] = False


@pytest.mark.parametrize("opname,transform", list(_grid()))
def test_grid(mesh, opname, transform, check_vma):
  op, run = OPS_BY_NAME[opname], TRANSFORMS[transform]
  got = _outcome(run, op.ours, mesh)
  if transform in op.refuses:  # ours refuses by design (what it refuses is said in REFUSALS)
    assert isinstance(got[1], NotImplementedError) and REFUSALS[transform] in str(got[1]), got
    return
  if transform == "vmap_named_axis":
    # What jax.lax does with its own op over a vmapped axis (no device communicates: this runs on
    # CPU for every op, pbroadcast and ragged_all_to_all included, or raises as it decides).
    _assert_same(got, _outcome(run, op.lax_op, mesh), f"{opname} {transform}")
    return
  if transform in op.lax_raises:
    assert _outcome(run, op.lax_op, mesh)[1] is not None, f"jax.lax's {opname} now supports {transform}"
  _assert_same(got, _outcome(run, op.ref(), mesh), f"{opname} {transform}")


@pytest.mark.parametrize("transform", ["jvp", "grad"])
@pytest.mark.parametrize("opname", ["psum", "pmean", "all_gather", "all_gather_tiled_ax1", "psum_scatter",
                                    "all_to_all", "ppermute", "pbroadcast", "ragged_all_to_all"])
def test_complex_tangents(mesh, opname, transform):
  """Complex values (carried as int32 words by the data-movement ops) keep their tangents."""
  op = OPS_BY_NAME[opname]
  x, t = _inputs(mesh, dtype=jnp.complex64), _inputs(mesh, seed=1, dtype=jnp.complex64)

  def run(fn):
    g = _program(fn, mesh)
    if transform == "jvp":
      return jax.jit(lambda a, b: jax.jvp(g, (a,), (b,)))(x, t)
    w = _weights(jax.eval_shape(g, x).shape)
    return jax.jit(jax.grad(lambda v: jnp.sum(jnp.abs(jnp.sin(g(v))) * w)))(x)
  got, want = run(op.ours), run(op.ref())
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.abs(np.asarray(b)).max() > 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("transform", ["jvp", "checkpoint"])
def test_start_form_of_complex_refuses_differentiation(mesh, transform):
  """A complex input of a start form travels as int32 words, whose tangents JAX would drop
  without asking the start's rules: refused, as for the runtimes' own dtypes."""
  fn = lambda v, ax: dc.done(dc.all_gather_start(v, ax, tiled=True))  # noqa: E731
  g = _program(fn, mesh)
  x = _inputs(mesh, dtype=jnp.complex64)
  with pytest.raises(NotImplementedError, match="not differentiable"):
    if transform == "jvp":
      jax.jvp(g, (x,), (x,))
    else:
      jax.grad(lambda v: jnp.sum(jnp.abs(jax.checkpoint(g)(v))))(x)


# ---------------------------------------------------------------- checkpoint: what is saved


def _residuals(fn, mesh):
  from jax._src.ad_checkpoint import saved_residuals
  g = jax.checkpoint(_program(fn, mesh))
  x = _inputs(mesh)
  w = _weights(jax.eval_shape(g, x).shape)
  return sorted((a.shape, str(a.dtype)) for a, _ in saved_residuals(_loss(g, w), x))


_RECOMPUTED_UNUSED = pytest.mark.xfail(strict=True, reason=(
    "under jax.checkpoint the blocking collective is staged again in the backward pass with its "
    "input saved, and its effect keeps it there although the transpose of a linear collective "
    "does not use it: one extra collective per checkpointed collective (core.py's remat rule)"))


@pytest.mark.parametrize("opname", [
    pytest.param(op.name, marks=() if op.name == "ragged_all_to_all" else _RECOMPUTED_UNUSED)
    for op in OPS if not op.refuses and not op.lax_raises])
def test_checkpoint_saves_what_lax_saves(mesh, opname):
  """Under jax.checkpoint the collectives are recomputed, not saved, as jax.lax's (traced only:
  jax.lax's pbroadcast and ragged_all_to_all need no CPU lowering for this)."""
  op = OPS_BY_NAME[opname]
  assert _residuals(op.ours, mesh) == _residuals(op.lax_op, mesh)


# ---------------------------------------------------------------- ragged_all_to_all: vmap details


@pytest.mark.parametrize("batched", ["all", "operand", "offsets"])
def test_ragged_vmap_any_argument_batched(mesh, batched):
  """vmap with only some arguments batched: each element as its own call (the rest broadcast)."""
  def call(op, out, off):
    return dc.ragged_all_to_all(op, out, *off, axis_name="y")

  def per_shard(v):
    r = lax.axis_index("y")
    ib = jnp.stack([jnp.stack([jnp.asarray(t)[r] for t in tabs]) for tabs in (TABLES, TABLES_2)])
    vb, ob = jnp.stack([v, v * 3.0]), jnp.stack([v[::-1], v + 5.0])
    axes = {"all": (0, 0, 0), "operand": (0, None, None), "offsets": (None, None, 0)}[batched]
    args = [a if d == 0 else a[0] for a, d in zip((vb, ob, ib), axes)]
    got = jax.vmap(call, in_axes=axes)(*args)
    want = jnp.stack([call(*(a[e] if d == 0 else a for a, d in zip(args, axes))) for e in range(2)])
    return jnp.stack([got, want])[None]
  sm = jax.shard_map(per_shard, mesh=mesh, in_specs=P("x", "y"), out_specs=P(("x", "y")), check_vma=False)
  out = np.asarray(jax.jit(sm)(_inputs(mesh)))
  np.testing.assert_array_equal(out[:, 0], out[:, 1])


def test_ragged_jacfwd_matches_jacrev(mesh):
  x = _inputs(mesh)
  g = lambda v: jnp.sum(_program(OPS_BY_NAME["ragged_all_to_all"].ours, mesh)(v) ** 2, axis=(0, 2))  # noqa: E731
  np.testing.assert_allclose(jax.jit(jax.jacfwd(g))(x), jax.jit(jax.jacrev(g))(x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- argument errors


def _call(lib_fn, mesh, ax="y"):
  def run():
    return jax.jit(_program(lib_fn, mesh, ax)).trace(_inputs(mesh)).lower()  # jax.lax checks some when lowering
  return run


def _rag(lib, **bad):
  """ragged_all_to_all with some arguments replaced (by name)."""
  names = ("operand", "output", "input_offsets", "send_sizes", "output_offsets", "recv_sizes")

  def f(v, ax):
    args = dict(zip(names, _ragged_args(v)))
    for k, val in bad.items():
      args[k] = val(args[k]) if callable(val) else val
    return lib.ragged_all_to_all(*[args[k] for k in names], axis_name=ax)
  return f


ERRORS = {
    # name: (f(lib) -> op(v, ax), axis name to call it with)
    "psum_unbound_axis": (lambda lib: lambda v, ax: lib.psum(v, ax), "z"),
    "pmean_unbound_axis": (lambda lib: lambda v, ax: lib.pmean(v, ax), "z"),
    "pmax_unbound_axis": (lambda lib: lambda v, ax: lib.pmax(v, ax), "z"),
    "all_gather_unbound_axis": (lambda lib: lambda v, ax: lib.all_gather(v, ax), "z"),
    "all_gather_bad_to": (lambda lib: lambda v, ax: lib.all_gather(v, ax, to="unreduced"), "y"),
    "psum_scatter_unbound_axis": (lambda lib: lambda v, ax: lib.psum_scatter(v, ax, tiled=True), "z"),
    "psum_scatter_indivisible": (lambda lib: lambda v, ax: lib.psum_scatter(v[:3], ax, tiled=True), "y"),
    "psum_scatter_untiled_size": (lambda lib: lambda v, ax: lib.psum_scatter(v[:3], ax), "y"),
    "all_to_all_unbound_axis": (lambda lib: lambda v, ax: lib.all_to_all(v, ax, 0, 1, tiled=True), "z"),
    "all_to_all_indivisible": (lambda lib: lambda v, ax: lib.all_to_all(v[:3], ax, 0, 1, tiled=True), "y"),
    "all_to_all_untiled_size": (lambda lib: lambda v, ax: lib.all_to_all(v[:3], ax, 0, 1), "y"),
    "ppermute_unbound_axis": (lambda lib: lambda v, ax: lib.ppermute(v, ax, [(0, 1)]), "z"),
    "ppermute_iterator_perm": (lambda lib: lambda v, ax: lib.ppermute(v, ax, iter([(0, 1)])), "y"),
    "ppermute_repeated_source": (lambda lib: lambda v, ax: lib.ppermute(v, ax, [(0, 1), (0, 2)]), "y"),
    "ppermute_repeated_dest": (lambda lib: lambda v, ax: lib.ppermute(v, ax, [(0, 1), (2, 1)]), "y"),
    "pbroadcast_unbound_axis": (lambda lib: lambda v, ax: lib.pbroadcast(v, ax, 0), "z"),
    "ragged_unbound_axis": (lambda lib: _rag(lib), "z"),
    "ragged_float_input_offsets": (lambda lib: _rag(lib, input_offsets=lambda a: a.astype(jnp.float32)), "y"),
    "ragged_float_send_sizes": (lambda lib: _rag(lib, send_sizes=lambda a: a.astype(jnp.float32)), "y"),
    "ragged_float_output_offsets": (lambda lib: _rag(lib, output_offsets=lambda a: a.astype(jnp.float32)), "y"),
    "ragged_float_recv_sizes": (lambda lib: _rag(lib, recv_sizes=lambda a: a.astype(jnp.float32)), "y"),
    "ragged_2d_input_offsets": (lambda lib: _rag(lib, input_offsets=lambda a: a[None]), "y"),
    "ragged_2d_recv_sizes": (lambda lib: _rag(lib, recv_sizes=lambda a: a[:, None]), "y"),
    "ragged_empty_send_sizes": (lambda lib: _rag(lib, send_sizes=lambda a: a[:0]), "y"),
    # Two faults: jax.lax reports the index arguments before the axis name.
    "ragged_float_offsets_and_unbound_axis": (
        lambda lib: _rag(lib, input_offsets=lambda a: a.astype(jnp.float32)), "z"),
    "ragged_2d_sizes_and_unbound_axis": (lambda lib: _rag(lib, send_sizes=lambda a: a[None]), "z"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_as_lax(mesh, case):
  make, ax = ERRORS[case]
  outcomes = {}
  for name, lib in (("lax", lax), ("dfccl", dc)):
    with pytest.raises(Exception) as info:
      _call(make(lib), mesh, ax)()
    outcomes[name] = info.value
  assert type(outcomes["dfccl"]) is type(outcomes["lax"]), outcomes


def test_ragged_index_errors_name_the_argument(mesh):
  for arg in ("input_offsets", "send_sizes", "output_offsets", "recv_sizes"):
    with pytest.raises(ValueError, match=f"{arg} must be integer type"):
      _call(_rag(dc, **{arg: lambda a: a.astype(jnp.float32)}), mesh, "z")()
    with pytest.raises(ValueError, match=f"{arg} must be rank 1"):
      _call(_rag(dc, **{arg: lambda a: a[None]}), mesh, "z")()
