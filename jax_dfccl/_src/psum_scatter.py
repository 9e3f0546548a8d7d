"""psum_scatter: reduce-scatter, drop-in for jax.lax.psum_scatter.
Canonical form: input (n, *S) -> output S (block `rank` of the sum)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import docstrings as ds
from jax_dfccl._src import frontend
from jax_dfccl._src import plan as pl
from jax_dfccl._src.psum import as_reducible


def _abstract(aval, n, params):
  from jax._src.lax.parallel import collective_vma_rule
  if not aval.shape or aval.shape[0] != n:
    raise ValueError(f"jax_dfccl: reduce-scatter canonical input must lead with {n}, got {aval.shape}")
  axes = set(params["axes"])
  if params.get("mode") == "unreduced":  # unreduced -> varying (jax.lax's unreduced_psum_scatter)
    return compat.update_mat(aval, aval.shape[1:], varying=compat.varying(aval) | axes,
                             unreduced=compat.unreduced(aval) - axes)
  compat.check_unreduced_args(aval, params["axes"], "reduce_scatter")
  vma = collective_vma_rule("reduce_scatter", params["axes"], aval)
  return compat.with_shape_vma(aval, aval.shape[1:], vma)


def _transpose(ct, params):
  ag = {k: v for k, v in params.items() if k != "mode"}
  if params.get("mode") == "unreduced":
    ag["mode"] = "reduced"  # as jax.lax: the transpose of an unreduced reduce-scatter
  return c.bind_blocking(ct, {**ag, "op": "all_gather"})


def _batch(x, d):
  return jnp.moveaxis(x, d, 1), 0


OP = c.register_op(c.OpDef("psum_scatter", "reduce_scatter", _abstract, _transpose, _batch, split="blocks_reduce"))


def _plan(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False, key=None):
  xs, tdef = jax.tree.flatten(x)
  # uint32 sums as jax.lax's (wrapping), complex sums as sums of (real, imag) pairs (a
  # trailing axis of 2, below the scattered dimension); bools stay refused, as by
  # jax.lax.psum_scatter.
  xs = list(map(jnp.asarray, xs))
  pairs = [jnp.issubdtype(v.dtype, jnp.complexfloating) for v in xs]
  conv = [(v, None) if v.dtype == jnp.bool_ else as_reducible(v, "sum") for v in xs]
  common, n, items, treedef = pl.leaves_of(jax.tree.unflatten(tdef, [v for v, _ in conv]), "psum_scatter",
                                          axis_name, key, "psum_scatter", axis_index_groups)
  leaves = []
  for (leaf, k, h), (_, back), pair in zip(items, conv, pairs):
    mode = compat.state_of(jax.typeof(leaf), common["axes"], "jax_dfccl.psum_scatter")
    if mode == "unreduced" and axis_index_groups is not None:
      raise NotImplementedError("jax_dfccl.psum_scatter: axis_index_groups with an unreduced input")
    nd, shape = leaf.ndim - (1 if pair else 0), leaf.shape  # the caller's rank (scatter_dimension's)
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
    params = dict(op="psum_scatter", **common, key=k, key_hash=h, reduce="sum", perm=())
    if mode == "unreduced":
      params["mode"] = mode
    leaves.append(pl.make_leaf(xc, params, back))
  return pl.bucket(leaves, treedef)


psum_scatter, psum_scatter_start = pl.api("psum_scatter", _plan)
psum_scatter = frontend.route("psum_scatter", psum_scatter)
psum_scatter_start = frontend.route("psum_scatter", psum_scatter_start, start=True)

_CALL = 'jax_dfccl.psum_scatter(v[0], "x", tiled=True)'
_ARGS = dict(x="jnp.arange(64).reshape(8, 8)", out_specs='P("x")')
_OUT = "[224 232 240 248 256 264 272 280]"
psum_scatter.__doc__ = f"""Sums ``x`` over ``axis_name`` and scatters the sum; drop-in for ``jax.lax.psum_scatter``.

  Rank ``i`` of the group gets block ``i`` of the sum along ``scatter_dimension`` (the
  reduce-scatter of the ring all-reduce, without its all-gather).

  Args:
    x: an array or a pytree of arrays (sums as :func:`jax_dfccl.psum`; bool refused, as
      ``jax.lax``).
    {ds.AXIS_NAME}
    scatter_dimension: the dimension of ``x`` split into the ranks' blocks.
    {ds.GROUPS}
    tiled: False: ``x.shape[scatter_dimension]`` equals the group size ``n`` and the result
      drops that dimension; True: it is divisible by ``n`` and the result keeps it, ``n``
      times smaller.
    {ds.KEY}

  Returns:
    This rank's block of the sum, of ``x``'s dtype.

  Raises:
    {ds.RAISES_AXIS}
    ValueError: ``scatter_dimension`` out of range, or its size not the group size
      (``tiled=False``) or not divisible by it (``tiled=True``).

  {ds.RUNTIME_ERROR}

  Example:
{ds.example(_CALL, _OUT, **_ARGS)}
  """
psum_scatter_start.__doc__ = ds.start_doc("psum_scatter", ds.example(ds.start_call(_CALL), _OUT, **_ARGS))
