"""ppermute: drop-in for jax.lax.ppermute (ranks with no source receive zeros)."""
from __future__ import annotations

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import docstrings as ds
from jax_dfccl._src import frontend
from jax_dfccl._src import plan as pl


def _abstract(aval, n, params):
  from jax._src.lax.parallel import collective_vma_rule
  compat.check_unreduced_args(aval, params["axes"], "ppermute")
  vma = collective_vma_rule("ppermute", params["axes"], aval)
  return compat.with_shape_vma(aval, aval.shape, vma)


def _transpose(ct, params):
  return c.bind_blocking(ct, {**params, "perm": tuple((d, s) for s, d in params["perm"])})


def _batch(x, d):
  return x, d


OP = c.register_op(c.OpDef("ppermute", "ppermute", _abstract, _transpose, _batch, split="elementwise"))


def _plan(x, axis_name, perm, *, key=None):
  if not isinstance(perm, (list, tuple)):  # an iterator would be used up by the first leaf
    raise TypeError("jax_dfccl.ppermute: `perm` passed to `jax.lax.ppermute` must be a list or a "
                    f"tuple (jax_dfccl.ppermute takes the same). Got perm of type {type(perm)}")
  common, n, items, treedef = pl.leaves_of(x, "ppermute", axis_name, key, "ppermute", movement=True)
  pairs = tuple((int(s), int(d)) for s, d in perm)
  srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
  if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
    raise ValueError(f"jax_dfccl.ppermute: perm sources and destinations must be unique, got {perm}")
  if any(not 0 <= i < n for i in srcs + dsts):
    raise ValueError(f"jax_dfccl.ppermute: perm {perm} has ranks outside [0, {n}) of axis {axis_name!r}")
  leaves = [pl.make_leaf(leaf, dict(op="ppermute", **common, key=k, key_hash=h, reduce="sum", perm=pairs))
            for leaf, k, h in items]
  return pl.bucket(leaves, treedef)


ppermute, ppermute_start = pl.api("ppermute", _plan)
ppermute = frontend.route("ppermute", ppermute)
ppermute_start = frontend.route("ppermute", ppermute_start, start=True)

_CALL = 'jax_dfccl.ppermute(v, "x", [(i, (i + 1) % 8) for i in range(8)])'
_ARGS = dict(x="jnp.arange(8)", out_specs='P("x")')
_OUT = "[7 0 1 2 3 4 5 6]"
ppermute.__doc__ = f"""Sends ``x`` along the pairs of ``perm``; drop-in for ``jax.lax.ppermute``.

  Args:
    x: an array or a pytree of arrays (any fixed-width dtype; the bytes are moved).
    {ds.AXIS_NAME}
    perm: a list or tuple of ``(source, destination)`` axis indices; each index at most once
      as a source and once as a destination.
    {ds.KEY}

  Returns:
    On each rank, what its source sent (``x``'s shapes and dtypes); zeros on a rank that is
    no pair's destination.

  Raises:
    {ds.RAISES_AXIS}
    TypeError: ``perm`` is not a list or a tuple (an iterator would be used up).
    ValueError: a repeated source or destination, or an index outside the axis.

  {ds.RUNTIME_ERROR}

  Example:
{ds.example(_CALL, _OUT, **_ARGS)}
  """
ppermute_start.__doc__ = ds.start_doc("ppermute", ds.example(ds.start_call(_CALL), _OUT, **_ARGS))
