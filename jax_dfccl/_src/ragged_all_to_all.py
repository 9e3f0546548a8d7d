"""ragged_all_to_all: the MoE dispatch/combine exchange (drop-in for
``jax.lax.ragged_all_to_all``).

The public function binds one primitive, ``dfccl_ragged_all_to_all``, with
``jax.lax``'s operands (operand, output, input_offsets, send_sizes,
output_offsets, recv_sizes) and rules: linear in operand and output (JVP: the
same exchange of the tangents; transpose: the cotangent sent back along the
same slices), offsets and sizes not differentiable, and batched by merging the
batch into the rows (as ``jax.lax``).  When the program is lowered it becomes
the canonical collective below.

Canonical form (the op table's ``ragged_all_to_all``, layout in
``xla_ffi/include/dfccl/ops.h``: ``RaggedHeader``): the input is one int32
buffer, a header of int64 words (row size, row counts, every slice's offsets
and sizes) followed by the operand's bytes; the output's initial value (the
caller's ``output``) is bound as ``init`` and aliased to the result, so rows
that nobody sends keep their values.  Offsets and sizes are device values: the
runtimes read them from the header when the collective runs (and check each
rank's ``recv_sizes`` against what its peers send: a mismatch is an error
naming the key and the ranks).
"""
from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax._src import core as jcore
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import docstrings as ds
from jax_dfccl._src import keys
from jax_dfccl._src import frontend
from jax_dfccl._src import order
from jax_dfccl._src import plan as pl

_API = "ragged_all_to_all"
_INDEX_NAMES = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")


# ---- the canonical collective (bound when the public primitive is lowered) ----

def _abstract(aval, n, params, init_aval=None):
  if init_aval is None:
    raise ValueError("jax_dfccl: ragged_all_to_all needs the output's initial value")
  return compat.with_shape_vma(init_aval, init_aval.shape, compat.varying(init_aval) | compat.varying(aval))


def _no_transpose(ct, params):
  raise NotImplementedError("jax_dfccl: ragged_all_to_all is differentiated by its public primitive")


def _no_batch(x, d):
  raise NotImplementedError("jax_dfccl: ragged_all_to_all is batched by its public primitive")


OP = c.register_op(c.OpDef(_API, "ragged_all_to_all", _abstract, _no_transpose, _no_batch))


def _int64_words(v):
  """An integer vector as int32 pairs (lo, hi) of its int64 value, flattened."""
  if np.dtype(v.dtype).itemsize == 8:
    return jax.lax.bitcast_convert_type(v, jnp.int32).reshape(-1)
  v = v.astype(jnp.int32)
  return jnp.stack([v, jnp.right_shift(v, 31)], axis=-1).reshape(-1)


def _local(operand, output, input_offsets, send_sizes, output_offsets):
  """A group of one rank: the rank's own slices placed into its output."""
  rows = jnp.arange(output.shape[0])
  out = output
  expand = (slice(None),) + (None,) * (output.ndim - 1)
  for j in range(input_offsets.shape[0]):
    lo, size = output_offsets[j], send_sizes[j]
    inside = (rows >= lo) & (rows < lo + size)
    src = jnp.clip(input_offsets[j] + rows - lo, 0, max(operand.shape[0] - 1, 0))
    out = jnp.where(inside[expand], operand[src] if operand.shape[0] else out, out)
  return out


def _leaf(x, output, idx, axes, groups, n, key, key_hash):
  """The canonical collective's Leaf for validated arguments."""
  common = dict(axes=axes, groups=groups)
  words_out, back = pl._to_words(output, 0)
  from jax_dfccl.config import config
  if n == 1 and not config.testing.runtime_for_groups_of_one:
    # Nothing to exchange: the local placement, through a collective that lowers to plain HLO
    # (with runtime_for_groups_of_one the ragged op itself goes to the runtime, below).
    res, _ = pl._to_words(_local(x, output, *idx[:3]), 0)
    params = dict(op="ppermute", **common, key=key, key_hash=key_hash, reduce="sum", perm=((0, 0),))
    return pl.Leaf(res, params, back)
  k = idx[0].shape[0] // n
  row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * np.dtype(x.dtype).itemsize
  fixed = np.array([row_bytes, x.shape[0], output.shape[0], k], np.int64).view(np.int32)
  header = jnp.concatenate([jnp.asarray(fixed), _int64_words(jnp.stack(idx, axis=1).reshape(-1))])
  words_in, _ = pl._to_words(x, 0)
  canon = c.make_varying(jnp.concatenate([header, words_in]), axes)
  params = dict(op=_API, **common, key=key, key_hash=key_hash, reduce="sum", perm=())
  return pl.Leaf(canon, params, back, init=(words_out,))


# ---- validation (jax.lax's order: the index arguments, then the axis name) ----

def _prepare(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name,
             axis_index_groups, key):
  """Checked arguments: (operand, output, idx, params of the public primitive)."""
  if len(jax.tree.leaves(operand)) != 1 or not jax.tree_util.treedef_is_leaf(jax.tree.structure(operand)):
    raise TypeError(f"jax_dfccl.{_API}: operand must be one array, not a pytree")
  idx = [jnp.asarray(v) for v in (input_offsets, send_sizes, output_offsets, recv_sizes)]
  for name, v in zip(_INDEX_NAMES, idx):
    if not jnp.issubdtype(v.dtype, jnp.integer):
      raise ValueError(f"jax_dfccl.{_API}: {name} must be integer type, got {v.dtype}")
  for name, v in zip(_INDEX_NAMES, idx):
    if v.ndim != 1 or v.shape[0] < 1:
      raise ValueError(f"jax_dfccl.{_API}: {name} must be rank 1 with positive dimension size, "
                       f"but got shape {v.shape}")
  axes = c.as_axes(axis_name)
  n = c.group_size(axes, _API)
  groups = pl.as_groups(axis_index_groups, n, _API)
  if groups:
    n = len(groups[0])
  operand, output = jnp.asarray(operand), jnp.asarray(output)
  pl.check_dtype(operand, _API, movement=True)
  if operand.ndim < 1 or output.ndim < 1:
    raise ValueError(f"jax_dfccl.{_API}: operand and output must have a leading (row) dimension, got "
                     f"shapes {operand.shape} and {output.shape}")
  if operand.dtype != output.dtype:
    raise TypeError(f"jax_dfccl.{_API}: operand and output dtypes differ ({operand.dtype} vs {output.dtype})")
  if operand.shape[1:] != output.shape[1:]:
    raise ValueError(f"jax_dfccl.{_API}: operand and output rows differ ({operand.shape[1:]} vs "
                     f"{output.shape[1:]})")
  if len({v.shape[0] for v in idx}) != 1:
    raise ValueError(f"jax_dfccl.{_API}: " + ", ".join(_INDEX_NAMES) + " must have equal lengths, got "
                     + str([v.shape[0] for v in idx]))
  if idx[0].shape[0] % n:
    raise ValueError(f"jax_dfccl.{_API}: the offsets' length {idx[0].shape[0]} is not a multiple of the "
                     f"group size {n}")
  operand, output = c.make_varying(operand, axes), c.make_varying(output, axes)
  k_name, k_hash = keys.make_key(_API, key, jax.typeof(operand), axes, f"|groups{groups}" if groups else "")
  return operand, output, idx, dict(axes=axes, groups=groups, n=n, key=k_name, key_hash=k_hash)


# ---- the public primitive and its rules ----

ragged_p = jcore.Primitive("dfccl_ragged_all_to_all")


def _ragged_abstract(operand, output, *idx, axes, groups, n, key, key_hash):
  vma = frozenset().union(*(compat.varying(a) for a in (operand, output, *idx)))
  out = compat.with_shape_vma(output, output.shape, vma)
  return out.update(weak_type=False), {c.dfccl_effect, *map(jcore.NamedAxisEffect, axes)}


ragged_p.def_effectful_abstract_eval(_ragged_abstract)
ragged_p.def_impl(c._no_impl)


def _expand(operand, output, *idx, axes, groups, n, key, key_hash):
  lf = _leaf(operand, output, list(idx), axes, groups, n, key, key_hash)
  return lf.post(c.bind_blocking(lf.x, lf.params, *lf.init))


mlir.register_lowering(ragged_p, mlir.lower_fun(_expand, multiple_results=False), cacheable=False)


def _ragged_jvp(primals, tangents, **params):
  operand, output, *idx = primals
  y = ragged_p.bind(*primals, **params)
  t_op, t_out = tangents[:2]
  if type(t_op) is ad.Zero and type(t_out) is ad.Zero:
    return y, ad.Zero(jcore.get_aval(y).to_tangent_aval())
  t_op, t_out = ad.instantiate_zeros(t_op), ad.instantiate_zeros(t_out)
  return y, ragged_p.bind(t_op, t_out, *idx, **keys.derive(params, "jvp"))


def _received_rows(rows, offsets, sizes):
  """Whether each of `rows` row indices lies in one of the slices [offsets[i], offsets[i] + sizes[i])."""
  r = jnp.arange(rows)[:, None]
  return jnp.any((r >= offsets[None, :]) & (r < (offsets + sizes)[None, :]), axis=1)


def _ragged_transpose(ct, operand, output, *idx, **params):
  if any(ad.is_undefined_primal(v) for v in idx):
    raise ValueError(f"jax_dfccl.{_API}: offsets and sizes are not differentiable")
  op_undef, out_undef = ad.is_undefined_primal(operand), ad.is_undefined_primal(output)
  if type(ct) is ad.Zero:
    return [ad.Zero(operand.aval) if op_undef else None, ad.Zero(output.aval) if out_undef else None,
            None, None, None, None]
  from jax_dfccl._src.all_to_all import all_to_all
  in_off, send, out_off, recv = idx
  axes, groups = params["axes"], params["groups"]
  tp = keys.derive(params, "T")
  # Where this rank's received slices sit in its output (as seen by their senders' offsets).
  out_off_t = all_to_all(out_off, axes, 0, 0, tiled=True, axis_index_groups=groups, key=tp["key"] + "_out_off")
  op_t = out_t = None
  if op_undef:
    # The cotangent of each received slice travels back to the rows it was sent from.
    in_off_t = all_to_all(in_off, axes, 0, 0, tiled=True, axis_index_groups=groups, key=tp["key"] + "_in_off")
    zeros = c.make_varying(jnp.zeros(operand.aval.shape, operand.aval.dtype), axes)
    op_t = ragged_p.bind(c.make_varying(ct, axes), zeros, out_off_t, recv, in_off_t, send, **tp)
  if out_undef:  # the rows that no slice overwrote keep the output's cotangent
    mask = _received_rows(ct.shape[0], out_off_t, recv).reshape((-1,) + (1,) * (ct.ndim - 1))
    out_t = jnp.where(mask, jnp.zeros_like(ct), ct)
  return [op_t, out_t, None, None, None, None]


def _ragged_batch(axis_data, vals_in, dims_in, **params):
  """As jax.lax: the batch merged into the rows (element b's operand rows at b * N, its output rows
  at b * M, its slices interleaved so that each still goes to the same rank)."""
  if axis_data.name is not None and axis_data.name in params["axes"]:
    raise NotImplementedError(f"jax_dfccl.{_API}: vmap over an axis it communicates over "
                              "(as jax.lax: not supported)")
  if all(d is None for d in dims_in):
    return ragged_p.bind(*vals_in, **params), None
  size = axis_data.size
  front = lambda v, d: jnp.broadcast_to(v, (size, *v.shape)) if d is None else jnp.moveaxis(v, d, 0)  # noqa: E731
  operand, output, in_off, send, out_off, recv = (front(v, d) for v, d in zip(vals_in, dims_in))
  rows_in, rows_out = operand.shape[1], output.shape[1]
  b = jnp.arange(size)[:, None]
  in_off = in_off + (b * rows_in).astype(in_off.dtype)
  out_off = out_off + (b * rows_out).astype(out_off.dtype)
  slices = [v.T.reshape(-1) for v in (in_off, send, out_off, recv)]  # (slice i, element b) at i * size + b
  y = ragged_p.bind(operand.reshape(-1, *operand.shape[2:]), output.reshape(-1, *output.shape[2:]), *slices,
                    **params)
  return y.reshape(size, rows_out, *y.shape[1:]), 0


ad.primitive_jvps[ragged_p] = _ragged_jvp
ad.primitive_transposes[ragged_p] = _ragged_transpose
batching.fancy_primitive_batchers[ragged_p] = _ragged_batch


def _ragged_pe_custom(saveable, unks_in, inst_in, eqn):
  """Under jax.checkpoint: recomputed unless the policy saves it (it is asked about this
  primitive and jax.lax's ragged_all_to_all_p), as jax.lax's collectives."""
  from jax._src.core import Var
  from jax._src.interpreters import partial_eval as pe
  from jax._src.lax import parallel
  res = [v for v, inst in zip(eqn.invars, inst_in) if type(v) is Var and not inst]
  if any(unks_in):
    return None, eqn, [True], [True], res
  avals = [v.aval for v in eqn.invars]
  cases = [pe.ensure_enum(saveable(eqn.primitive, *avals, **eqn.params))]
  try:
    cases.append(pe.ensure_enum(saveable(parallel.ragged_all_to_all_p, *avals, axis_name=eqn.params["axes"],
                                         axis_index_groups=eqn.params["groups"])))
  except (KeyError, TypeError, AttributeError):  # a policy reading params of jax.lax's own
    pass
  if not all(isinstance(cs, pe.RecomputeType) for cs in cases):
    return eqn, None, [False], [False], []
  return eqn, eqn, [False], [True], res


def _register_remat():
  from jax._src.interpreters import partial_eval as pe
  pe.partial_eval_jaxpr_custom_rules[ragged_p] = _ragged_pe_custom


_register_remat()


# ---- public functions ----

_EXAMPLE = """    >>> mesh = jax.sharding.Mesh(jax.devices()[:2], ("x",))
    >>> def g(a, b, c, d, e, f):
    ...   y = {call}(a[0], b[0], c[0], d[0], e[0], f[0], axis_name="x")
    ...   return {result}[None]
    >>> g = jax.jit(jax.shard_map(g, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    >>> print(g(jnp.array([[1, 2, 2], [3, 4, 0]]), jnp.zeros((2, 4), jnp.int32),
    ...         jnp.array([[0, 1], [0, 1]]), jnp.array([[1, 2], [1, 1]]),
    ...         jnp.array([[0, 0], [1, 2]]), jnp.array([[1, 1], [2, 1]])))
    [[1 3 0 0]
     [2 2 4 0]]
"""


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                      axis_index_groups=None, key=None):
  operand, output, idx, params = _prepare(operand, output, input_offsets, send_sizes, output_offsets,
                                          recv_sizes, axis_name, axis_index_groups, key)
  return order.bind_blocking(ragged_p, operand, output, *idx, **params)


def _start_plan(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                axis_index_groups=None, key=None):
  output = frontend.no_tangent(output, all_inexact=True)  # (the operand's: the route's, below)
  operand, output, idx, p = _prepare(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name, axis_index_groups, key)
  return [_leaf(operand, output, idx, p["axes"], p["groups"], p["n"], p["key"], p["key_hash"])], \
      jax.tree.structure(0)


_unused_blocking, ragged_all_to_all_start = pl.api(_API, _start_plan)
ragged_all_to_all = frontend.route(_API, ragged_all_to_all)
ragged_all_to_all_start = frontend.route(_API, ragged_all_to_all_start, start=True)


ragged_all_to_all.__doc__ = f"""Sends ragged slices of ``operand`` to the ranks of ``axis_name``; drop-in for ``jax.lax.ragged_all_to_all``.

  The exchange of a mixture-of-experts layer's tokens.  With ``K = len(input_offsets)`` and
  ``k = K // n`` slices per rank (``n`` the group size), slice ``i`` (the rows
  ``input_offsets[i]`` to ``input_offsets[i] + send_sizes[i]`` of ``operand``) goes to rank
  ``i // k``, where it is written at row ``output_offsets[i]`` of its result; the result
  is ``output`` with every received slice written in.  ``recv_sizes[i]`` is the number of
  rows this rank receives as slice ``i % k`` of rank ``i // k`` (the runtime checks it
  against what that rank sends).  Offsets and sizes may be traced values.

  Differentiable as ``jax.lax``'s (linear in ``operand`` and ``output``: ``jax.jvp``,
  ``jax.grad``, ``jax.linearize``; offsets and sizes are not differentiated) and batched
  by ``jax.vmap`` (the batch merged into the rows).

  Args:
    operand: the rows to send, shape ``(N, *R)``.
    output: the result's initial value, shape ``(M, *R)``, ``operand``'s dtype.
    input_offsets: int array ``(K,)``: where each slice starts in ``operand``.
    send_sizes: int array ``(K,)``: each slice's rows.
    output_offsets: int array ``(K,)``: where each slice lands on its destination.
    recv_sizes: int array ``(K,)``: the rows received per slice (see above).
    {ds.AXIS_NAME}
    {ds.GROUPS}
    {ds.KEY}

  Returns:
    ``output`` with the received slices written in (shape ``(M, *R)``).

  Raises:
    ValueError: an offsets or sizes argument that is not of integer type, not of rank 1 or
      empty (named, and checked before the axis name, as ``jax.lax``); lengths that differ
      or are not a multiple of the group size; rows of ``operand`` and ``output`` that differ.
    {ds.RAISES_AXIS}  Operand and output of different dtypes are a TypeError.
    NotImplementedError: under ``jax.vmap`` over an axis name it communicates over (as
      ``jax.lax``).

  {ds.RUNTIME_ERROR}

  The example is ``jax.lax.ragged_all_to_all``'s, on two devices.

  Example:
{_EXAMPLE.format(call="jax_dfccl.ragged_all_to_all", result="y")}
  """
ragged_all_to_all_start.__doc__ = ds.start_doc(_API, _EXAMPLE.format(
    call="jax_dfccl.ragged_all_to_all_start", result="jax_dfccl.done(y)"))
