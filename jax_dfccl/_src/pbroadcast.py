"""pbroadcast: every rank of the group receives rank ``source``'s value
(drop-in for ``jax.lax.pbroadcast``).  Canonical form: in E -> out E with
out = in_source (the op table's ``broadcast``)."""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import docstrings as ds
from jax_dfccl._src import frontend
from jax_dfccl._src import plan as pl


def _abstract(aval, n, params):
  from jax._src.lax.parallel import collective_vma_rule
  vma = collective_vma_rule("pbroadcast", params["axes"], aval)
  return compat.with_shape_vma(aval, aval.shape, vma)


def _transpose(ct, params):
  # As jax.lax: the source receives the sum of every rank's cotangent, the others zero.
  (source, _), = params["perm"]
  total = c.bind_blocking(ct, {**params, "op": "psum", "perm": ()})
  is_source = jax.lax.axis_index(params["axes"]) == source
  return jnp.where(is_source, total, jnp.zeros_like(total))


def _batch(x, d):
  return x, d


OP = c.register_op(c.OpDef("pbroadcast", "broadcast", _abstract, _transpose, _batch, split="elementwise"))


def _plan(x, axis_name, source, *, key=None):
  common, n, items, treedef = pl.leaves_of(x, "pbroadcast", axis_name, key, "pbroadcast", movement=True)
  try:
    src = operator.index(source)
  except TypeError:
    raise TypeError(f"jax_dfccl.pbroadcast: source must be a Python int (a rank of axis {axis_name!r}), "
                    f"got {source!r}; for a traced source use psum(where(axis_index(axis_name) == source, "
                    "x, 0), axis_name)") from None
  if not 0 <= src < n:
    raise ValueError(f"jax_dfccl.pbroadcast: source {src} is outside [0, {n}) of axis {axis_name!r}")
  leaves = [pl.make_leaf(leaf, dict(op="pbroadcast", **common, key=k, key_hash=h, reduce="sum", perm=((src, -1),)))
            for leaf, k, h in items]
  return pl.bucket(leaves, treedef)


pbroadcast, pbroadcast_start = pl.api("pbroadcast", _plan)
pbroadcast = frontend.route("pbroadcast", pbroadcast)
pbroadcast_start = frontend.route("pbroadcast", pbroadcast_start, start=True)

_CALL = 'jax_dfccl.pbroadcast(v, "x", 3)'
_ARGS = dict(x="jnp.arange(8.0)", out_specs='P("x")')
_OUT = "[3. 3. 3. 3. 3. 3. 3. 3.]"
pbroadcast.__doc__ = f"""Gives every rank of ``axis_name`` the ``x`` of rank ``source``; drop-in for ``jax.lax.pbroadcast``.

  The same as ``psum(where(axis_index(axis_name) == source, x, 0), axis_name)`` (jax.lax's
  definition, and its gradient: the source receives the sum of the cotangents), moving the
  bytes once.

  Args:
    x: an array or a pytree of arrays (any fixed-width dtype).
    {ds.AXIS_NAME}
    source: the axis index whose value everyone receives (a Python int).
    {ds.KEY}

  Returns:
    Rank ``source``'s ``x``, on every rank.

  Raises:
    {ds.RAISES_AXIS}  A traced ``source`` is a TypeError (use the definition above).
    ValueError: ``source`` outside the axis.

  {ds.RUNTIME_ERROR}

  Example:
{ds.example(_CALL, _OUT, **_ARGS)}
  """
pbroadcast_start.__doc__ = ds.start_doc("pbroadcast", ds.example(ds.start_call(_CALL), _OUT, **_ARGS))
