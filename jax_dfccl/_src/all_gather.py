"""all_gather: drop-in for jax.lax.all_gather.  Canonical form: (n, *S) stack."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import docstrings as ds
from jax_dfccl._src import frontend
from jax_dfccl._src import plan as pl


def _abstract(aval, n, params):
  from jax._src.lax.parallel import collective_vma_rule
  axes, mode = params["axes"], params.get("mode", "varying")
  compat.check_unreduced_args(aval, axes, "all_gather")
  vma = collective_vma_rule("all_gather", axes, aval)
  if mode == "varying":
    return compat.with_shape_vma(aval, (n, *aval.shape), vma)
  # to='invarying': the same on every rank of the group; to='reduced': also typed
  # as reduced over the axes (its cotangent is an unreduced sum).
  out = compat.update_mat(aval, (n, *aval.shape), varying=vma - set(axes))
  return compat.update_mat(out, reduced=compat.reduced(aval) | set(axes)) if mode == "reduced" else out


def _transpose(ct, params):
  mode = params.get("mode", "varying")
  if mode == "invarying":  # each rank keeps its own block of the invariant cotangent: no communication
    return ct[jax.lax.axis_index(params["axes"])]
  # The canonical all_gather's transpose is the canonical reduce-scatter (of an
  # unreduced cotangent for to='reduced').
  rs = {k: v for k, v in params.items() if k != "mode"}
  if mode == "reduced":
    rs["mode"] = "unreduced"
  return c.bind_blocking(ct, {**rs, "op": "psum_scatter", "reduce": "sum"})


def _batch(x, d):
  return x, d + 1


OP = c.register_op(c.OpDef("all_gather", "all_gather", _abstract, _transpose, _batch, split="gather"))


_TO = ("varying", "reduced", "invarying")


def _plan(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False, to="varying", key=None):
  if to not in _TO:
    raise ValueError("jax_dfccl.all_gather: Got unexpected `to` value for `jax.lax.all_gather`. "
                     f"Allowed `to` values are: {set(_TO)}")
  if to != "varying" and not compat.check_vma_enabled():
    to = "varying"  # as jax.lax: without check_vma the types do not say
  if to != "varying" and axis_index_groups is not None:
    raise NotImplementedError(f"jax_dfccl.all_gather: to={to!r} with axis_index_groups (as jax.lax)")
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

    params = dict(op="all_gather", **common, key=k, key_hash=h, reduce="sum", perm=())
    if to != "varying":
      params["mode"] = to
    leaves.append(pl.make_leaf(leaf, params, post))
  return pl.bucket(leaves, treedef)


all_gather, all_gather_start = pl.api("all_gather", _plan)
all_gather = frontend.route("all_gather", all_gather)
all_gather_start = frontend.route("all_gather", all_gather_start, start=True)

_CALL, _OUT = 'jax_dfccl.all_gather(v, "x", tiled=True, to="invarying")', "[0 1 2 3 4 5 6 7]"
all_gather.__doc__ = f"""Gathers ``x`` from every rank of ``axis_name``; drop-in for ``jax.lax.all_gather``.

  Args:
    x: an array or a pytree of arrays (any fixed-width dtype; the bytes are moved).
    {ds.AXIS_NAME}
    {ds.GROUPS}
    axis: where the ranks' blocks go: a new dimension at ``axis`` (``tiled=False``) or the
      existing dimension ``axis`` they are concatenated along (``tiled=True``).
    tiled: stack (False) or concatenate (True) the blocks.
    to: the result's manual-axis type, as in ``jax.lax.all_gather``: ``'varying'``
      (default), ``'invarying'`` (the same on every rank; its gradient is each rank's block,
      without communication) or ``'reduced'`` (its gradient is a reduce-scatter of the
      unreduced cotangent).  Without ``check_vma`` only ``'varying'`` applies.
    {ds.KEY}

  Returns:
    ``x`` gathered in rank order: ``x.shape`` with the group size ``n`` inserted at ``axis``
    (``tiled=False``) or with ``x.shape[axis]`` multiplied by ``n`` (``tiled=True``).

  Raises:
    {ds.RAISES_AXIS}
    ValueError: ``axis`` out of range, ``tiled=True`` on a scalar, or an unknown ``to``.
    NotImplementedError: ``to`` other than ``'varying'`` with ``axis_index_groups``, as jax.lax.

  {ds.RUNTIME_ERROR}

  Example:
{ds.example(_CALL, _OUT, x="jnp.arange(8)")}
  """
all_gather_start.__doc__ = ds.start_doc("all_gather", ds.example(ds.start_call(_CALL), _OUT, x="jnp.arange(8)"))
