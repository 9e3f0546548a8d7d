"""psum_scatter: reduce-scatter, drop-in for jax.lax.psum_scatter.
Canonical form: input (n, *S) -> output S (block `rank` of the sum)."""
from __future__ import annotations

import jax.numpy as jnp

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import plan as pl


def _abstract(aval, n, params):
  from jax._src.lax.parallel import collective_vma_rule
  if not aval.shape or aval.shape[0] != n:
    raise ValueError(f"jax_dfccl: reduce-scatter canonical input must lead with {n}, got {aval.shape}")
  vma = collective_vma_rule("reduce_scatter", params["axes"], aval)
  return compat.with_shape_vma(aval, aval.shape[1:], vma)


def _transpose(ct, params):
  return c.bind_blocking(ct, {**params, "op": "all_gather"})


def _batch(x, d):
  return jnp.moveaxis(x, d, 1), 0


OP = c.register_op(c.OpDef("psum_scatter", "reduce_scatter", _abstract, _transpose, _batch))


def _plan(x, axis_name, *, scatter_dimension=0, tiled=False, axis_index_groups=None, key=None):
  common, n, items, treedef = pl.leaves_of(x, "psum_scatter", axis_name, key, "psum_scatter",
                                          axis_index_groups)
  leaves = []
  for leaf, k, h in items:
    nd, shape = leaf.ndim, leaf.shape
    sd = scatter_dimension + nd if scatter_dimension < 0 else scatter_dimension
    if not 0 <= sd < nd:
      raise ValueError(f"jax_dfccl.psum_scatter: scatter_dimension {scatter_dimension} out of "
                       f"range for a rank-{nd} input")
    if tiled:
      if shape[sd] % n:
        raise ValueError(f"jax_dfccl.psum_scatter: dimension {sd} of size {shape[sd]} is not "
                         f"divisible by the group size {n} of axis {axis_name!r}")
      xc = leaf.reshape(shape[:sd] + (n, shape[sd] // n) + shape[sd + 1:])
      xc = jnp.moveaxis(xc, sd, 0)
    else:
      if shape[sd] != n:
        raise ValueError(f"jax_dfccl.psum_scatter: dimension {sd} has size {shape[sd]}, but "
                         f"tiled=False needs the group size {n} of axis {axis_name!r}")
      xc = jnp.moveaxis(leaf, sd, 0)
    leaves.append(pl.make_leaf(xc, dict(op="psum_scatter", **common, key=k, key_hash=h, reduce="sum", perm=())))
  return pl.bucket(leaves, treedef)


psum_scatter, psum_scatter_start = pl.api("psum_scatter", _plan)
psum_scatter.__doc__ = """Sums over ``axis_name`` and scatters along ``scatter_dimension``;
drop-in for ``jax.lax.psum_scatter``."""
