"""ragged_all_to_all: the MoE dispatch/combine exchange (drop-in for
``jax.lax.ragged_all_to_all``).

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

import functools

import numpy as np

import jax
import jax.numpy as jnp

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import plan as pl

_API = "ragged_all_to_all"


def _abstract(aval, n, params, init_aval=None):
  if init_aval is None:
    raise ValueError("jax_dfccl: ragged_all_to_all needs the output's initial value")
  return compat.with_shape_vma(init_aval, init_aval.shape, compat.varying(init_aval) | compat.varying(aval))


def _no_transpose(ct, params):
  raise NotImplementedError("jax_dfccl: ragged_all_to_all is differentiated by its public function only")


def _batch(x, d):
  raise NotImplementedError("jax_dfccl: vmap of ragged_all_to_all is not supported")


OP = c.register_op(c.OpDef(_API, "ragged_all_to_all", _abstract, _no_transpose, _batch))


def _int64_words(v):
  """An integer vector as int32 pairs (lo, hi) of its int64 value, flattened."""
  if np.dtype(v.dtype).itemsize == 8:
    return jax.lax.bitcast_convert_type(v, jnp.int32).reshape(-1)
  v = v.astype(jnp.int32)
  return jnp.stack([v, jnp.right_shift(v, 31)], axis=-1).reshape(-1)


def _check(operand, output, idx, n):
  if operand.ndim < 1 or output.ndim < 1:
    raise ValueError(f"jax_dfccl.{_API}: operand and output must have a leading (row) dimension, got "
                     f"shapes {operand.shape} and {output.shape}")
  if operand.dtype != output.dtype:
    raise TypeError(f"jax_dfccl.{_API}: operand and output dtypes differ ({operand.dtype} vs {output.dtype})")
  if operand.shape[1:] != output.shape[1:]:
    raise ValueError(f"jax_dfccl.{_API}: operand and output rows differ ({operand.shape[1:]} vs "
                     f"{output.shape[1:]})")
  names = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
  for name, v in zip(names, idx):
    if v.ndim != 1 or not jnp.issubdtype(v.dtype, jnp.integer):
      raise TypeError(f"jax_dfccl.{_API}: {name} must be a 1-D integer array, got {v.dtype}{list(v.shape)}")
  if len({v.shape[0] for v in idx}) != 1:
    raise ValueError(f"jax_dfccl.{_API}: " + ", ".join(names) + " must have equal lengths, got "
                     + str([v.shape[0] for v in idx]))
  if idx[0].shape[0] % n:
    raise ValueError(f"jax_dfccl.{_API}: the offsets' length {idx[0].shape[0]} is not a multiple of the "
                     f"group size {n}")
  return idx[0].shape[0] // n


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


def _plan(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
          axis_index_groups=None, key=None):
  common, n, items, treedef = pl.leaves_of(operand, _API, axis_name, key, _API, axis_index_groups, movement=True)
  if len(items) != 1:
    raise TypeError(f"jax_dfccl.{_API}: operand must be one array, not a pytree")
  (x, k_name, k_hash), = items
  output = c.make_varying(jnp.asarray(output), common["axes"])
  idx = [jnp.asarray(v) for v in (input_offsets, send_sizes, output_offsets, recv_sizes)]
  k = _check(x, output, idx, n)
  words_out, back = pl._to_words(output, 0)
  from jax_dfccl.config import config
  if n == 1 and not config.testing.runtime_for_groups_of_one:
    # Nothing to exchange: the local placement, through a collective that lowers to plain HLO
    # (with runtime_for_groups_of_one the ragged op itself goes to the runtime, below).
    res, _ = pl._to_words(_local(x, output, *idx[:3]), 0)
    params = dict(op="ppermute", **common, key=k_name, key_hash=k_hash, reduce="sum", perm=((0, 0),))
    return [pl.Leaf(res, params, back)], treedef
  row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * np.dtype(x.dtype).itemsize
  fixed = np.array([row_bytes, x.shape[0], output.shape[0], k], np.int64).view(np.int32)
  header = jnp.concatenate([jnp.asarray(fixed), _int64_words(jnp.stack(idx, axis=1).reshape(-1))])
  words_in, _ = pl._to_words(x, 0)
  canon = c.make_varying(jnp.concatenate([header, words_in]), common["axes"])
  params = dict(op=_API, **common, key=k_name, key_hash=k_hash, reduce="sum", perm=())
  return [pl.Leaf(canon, params, back, init=(words_out,))], treedef


_blocking, _start = pl.api(_API, _plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _differentiable(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name, groups, key):
  return _blocking(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                   axis_name=axis_name, axis_index_groups=groups, key=key)


def _fwd(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name, groups, key):
  out = _differentiable(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                        axis_name, groups, key)
  return out, (operand, input_offsets, send_sizes, output_offsets, recv_sizes)


def _bwd(axis_name, groups, key, res, ct):
  # As jax.lax: the operand's cotangent travels back along the same slices;
  # the output's is the cotangent outside the received rows.
  from jax_dfccl._src.all_to_all import all_to_all
  operand, input_offsets, send_sizes, output_offsets, recv_sizes = res
  tkey = None if key is None else key + "/T"
  out_off = all_to_all(output_offsets, axis_name, 0, 0, tiled=True, axis_index_groups=groups,
                       key=None if key is None else key + "/T_out_off")
  in_off = all_to_all(input_offsets, axis_name, 0, 0, tiled=True, axis_index_groups=groups,
                      key=None if key is None else key + "/T_in_off")
  operand_t = _blocking(ct, jnp.zeros_like(operand), out_off, recv_sizes, in_off, send_sizes,
                        axis_name=axis_name, axis_index_groups=groups, key=tkey)
  rows = jnp.arange(ct.shape[0])
  received = jnp.zeros(ct.shape[0], bool)
  for i in range(out_off.shape[0]):
    received = received | ((rows >= out_off[i]) & (rows < out_off[i] + recv_sizes[i]))
  output_t = jnp.where(received.reshape((-1,) + (1,) * (ct.ndim - 1)), jnp.zeros_like(ct), ct)
  return operand_t, output_t, None, None, None, None


_differentiable.defvjp(_fwd, _bwd)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                      axis_index_groups=None, key=None):
  """Sends slice ``i`` of ``operand`` (rows ``input_offsets[i]`` to ``+ send_sizes[i]``) to rank
  ``i // k`` of ``axis_name`` (``k`` slices per rank), where it lands at row ``output_offsets[i]`` of
  that rank's result; the result is ``output`` with every received slice written in
  (``recv_sizes[i]``: rows received as rank ``i // k``'s slice ``i % k``).  Drop-in for
  ``jax.lax.ragged_all_to_all``; offsets and sizes may be traced values.  Differentiable
  (reverse mode) as in ``jax.lax``."""
  groups = None if axis_index_groups is None else tuple(tuple(int(i) for i in g) for g in axis_index_groups)
  return _differentiable(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                         axis_name, groups, key)


def ragged_all_to_all_start(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                            axis_name, axis_index_groups=None, key=None):
  """Starts :func:`ragged_all_to_all` and returns a handle; ``jax_dfccl.done(handle)`` returns
  its result (not differentiable)."""
  return _start(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name,
                axis_index_groups=axis_index_groups, key=key)
