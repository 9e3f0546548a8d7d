"""all_gather: drop-in for jax.lax.all_gather.  Canonical form: (n, *S) stack."""
from __future__ import annotations

import jax.numpy as jnp

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import plan as pl


def _abstract(aval, n, params):
  from jax._src.lax.parallel import collective_vma_rule
  vma = collective_vma_rule("all_gather", params["axes"], aval)
  return compat.with_shape_vma(aval, (n, *aval.shape), vma)


def _transpose(ct, params):
  # The canonical all_gather's transpose is the canonical reduce-scatter.
  return c.bind_blocking(ct, {**params, "op": "psum_scatter", "reduce": "sum"})


def _batch(x, d):
  return x, d + 1


OP = c.register_op(c.OpDef("all_gather", "all_gather", _abstract, _transpose, _batch))


def _plan(x, axis_name, *, axis=0, tiled=False, axis_index_groups=None, key=None):
  common, n, items, treedef = pl.leaves_of(x, "all_gather", axis_name, key, "all_gather", axis_index_groups,
                                          movement=True)
  leaves = []
  for leaf, k, h in items:
    nd = leaf.ndim
    ax = axis + nd + (0 if tiled else 1) if axis < 0 else axis
    if not (0 <= ax < (nd if tiled else nd + 1)):
      raise ValueError(f"jax_dfccl.all_gather: axis {axis} out of range for a rank-{nd} input")
    if tiled and nd == 0:
      raise ValueError("jax_dfccl.all_gather: tiled=True needs an input of rank >= 1")
    shape = leaf.shape

    def post(y, ax=ax, shape=shape):
      y = jnp.moveaxis(y, 0, ax)  # (.., n, S_ax, ..)
      if tiled:
        y = y.reshape(shape[:ax] + (n * shape[ax],) + shape[ax + 1:])
      return y

    leaves.append(pl.make_leaf(leaf, dict(op="all_gather", **common, key=k, key_hash=h, reduce="sum", perm=()),
                              post))
  return pl.bucket(leaves, treedef)


all_gather, all_gather_start = pl.api("all_gather", _plan)
all_gather.__doc__ = """Gathers ``x`` from every rank of ``axis_name``; drop-in for ``jax.lax.all_gather``.

``tiled=False`` stacks along a new dimension ``axis``; ``tiled=True`` concatenates
along the existing dimension ``axis``."""
