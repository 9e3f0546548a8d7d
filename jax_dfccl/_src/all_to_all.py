"""all_to_all: drop-in for jax.lax.all_to_all.
Canonical form: (n, *S) -> (n, *S) with out[r] = x_r[rank]."""
from __future__ import annotations

import jax.numpy as jnp

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import docstrings as ds
from jax_dfccl._src import frontend
from jax_dfccl._src import plan as pl


def _abstract(aval, n, params):
  from jax._src.lax.parallel import collective_vma_rule
  if not aval.shape or aval.shape[0] != n:
    raise ValueError(f"jax_dfccl: all_to_all canonical input must lead with {n}, got {aval.shape}")
  compat.check_unreduced_args(aval, params["axes"], "all_to_all")
  vma = collective_vma_rule("all_to_all", params["axes"], aval)
  return compat.with_shape_vma(aval, aval.shape, vma)


def _transpose(ct, params):
  return c.bind_blocking(ct, params)  # a permutation of blocks across ranks: self-transpose


def _batch(x, d):
  return jnp.moveaxis(x, d, 1), 1


OP = c.register_op(c.OpDef("all_to_all", "all_to_all", _abstract, _transpose, _batch, split="blocks"))


def _tiled_post(n, shape, ca):
  def post(y):
    y = jnp.moveaxis(y, 0, ca)
    return y.reshape(shape[:ca] + (n * shape[ca],) + shape[ca + 1:])
  return post


def _plan(x, axis_name, split_axis, concat_axis, *, axis_index_groups=None, tiled=False, key=None):
  common, n, items, treedef = pl.leaves_of(x, "all_to_all", axis_name, key, "all_to_all", axis_index_groups,
                                          movement=True)
  leaves = []
  for leaf, k, h in items:
    nd = leaf.ndim
    sa = split_axis + nd if split_axis < 0 else split_axis
    ca = concat_axis + nd if concat_axis < 0 else concat_axis
    if not (0 <= sa < nd and 0 <= ca < nd):
      raise ValueError(f"jax_dfccl.all_to_all: split_axis {split_axis} / concat_axis "
                       f"{concat_axis} out of range for a rank-{nd} input")
    if tiled:
      if leaf.shape[sa] % n:
        raise ValueError(f"jax_dfccl.all_to_all: split dimension {sa} of size {leaf.shape[sa]} "
                         f"is not divisible by the group size {n} of axis {axis_name!r}")
      post = None
    else:
      if leaf.shape[sa] != n:
        raise ValueError(f"jax_dfccl.all_to_all: split dimension {sa} has size "
                         f"{leaf.shape[sa]}, but tiled=False needs the group size {n}")
      # As jax.lax: a size-1 concat dimension, a tiled exchange, then drop the split dim.
      if sa < ca:
        ca += 1  # concat_axis is a position after split_axis is removed
        leaf = jnp.expand_dims(leaf, ca)
      elif sa > ca:
        leaf = jnp.expand_dims(leaf, ca)
        sa += 1
      post = (lambda y, sa=sa: jnp.squeeze(y, sa)) if sa != ca else (lambda y: y)
    shape = leaf.shape
    xc = leaf.reshape(shape[:sa] + (n, shape[sa] // n) + shape[sa + 1:])
    xc = jnp.moveaxis(xc, sa, 0)
    chunk = shape[:sa] + (shape[sa] // n,) + shape[sa + 1:]
    tiled_post = _tiled_post(n, chunk, ca)
    full_post = tiled_post if post is None else (lambda y, a=tiled_post, b=post: b(a(y)))
    leaves.append(pl.make_leaf(xc, dict(op="all_to_all", **common, key=k, key_hash=h, reduce="sum", perm=()),
                              full_post, lead=1))
  return pl.bucket(leaves, treedef)


all_to_all, all_to_all_start = pl.api("all_to_all", _plan)
all_to_all = frontend.route("all_to_all", all_to_all)
all_to_all_start = frontend.route("all_to_all", all_to_all_start, start=True)

_CALL = 'jax_dfccl.all_to_all(v, "x", 1, 0, tiled=True)'
_ARGS = dict(x="jnp.arange(64).reshape(8, 8)", out_specs='P(None, "x")', show="(f(x) == x).all()")
all_to_all.__doc__ = f"""Exchanges blocks of ``x`` between the ranks of ``axis_name``; drop-in for ``jax.lax.all_to_all``.

  ``x`` is split along ``split_axis`` into one block per rank; rank ``i`` receives block
  ``i`` of every rank and concatenates them, in rank order, along ``concat_axis``.

  Args:
    x: an array or a pytree of arrays (any fixed-width dtype; the bytes are moved).
    {ds.AXIS_NAME}
    split_axis: the dimension of ``x`` split into blocks.
    concat_axis: the dimension the received blocks are concatenated along.
    {ds.GROUPS}
    tiled: False: ``x.shape[split_axis]`` equals the group size, that dimension is removed
      and a new one of the group size is inserted at ``concat_axis``; True: the split
      dimension is divisible by the group size and the blocks are concatenated along the
      existing ``concat_axis``.
    {ds.KEY}

  Returns:
    The received blocks, of ``x``'s dtype.

  Raises:
    {ds.RAISES_AXIS}
    ValueError: an axis out of range, or a split dimension that does not fit the group size.

  {ds.RUNTIME_ERROR}

  The example reshards a matrix from rows to columns: rank ``i`` holds row ``i`` before and
  column ``i`` after (the same global matrix).

  Example:
{ds.example(_CALL, "True", **_ARGS)}
  """
all_to_all_start.__doc__ = ds.start_doc("all_to_all", ds.example(ds.start_call(_CALL), "True", **_ARGS))
