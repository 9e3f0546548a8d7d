"""psum / pmax / pmin: all-reduce over one or more mesh axes (drop-in for jax.lax)."""
from __future__ import annotations

import jax.numpy as jnp

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import plan as pl


def _abstract(aval, n, params):
  # Over the whole axis the result is the same on every rank (invariant); with
  # axis_index_groups it differs between groups and stays varying.
  vma = compat.varying(aval) if params["groups"] else compat.varying(aval) - set(params["axes"])
  return compat.with_shape_vma(aval, aval.shape, vma)


def _transpose(ct, params):
  if params["reduce"] != "sum":
    raise NotImplementedError("jax_dfccl: pmax/pmin are not linear")
  if compat.check_vma_enabled():
    # Invariant -> varying: psum's transpose is a pvary (no communication).
    return compat.pvary(ct, params["axes"])
  return c.bind_blocking(ct, params)  # as jax.lax.psum without check_vma


def _batch(x, d):
  return x, d


def _jvp(x, t, params):
  y = c.collective_p.bind(x, **params)
  if type(t) is c.ad.Zero:
    return y, c.ad.Zero(c.core.get_aval(y).to_tangent_aval())
  if params["reduce"] == "sum":
    return y, c.collective_p.bind(t, **c.derive(params, "jvp"))
  # pmax/pmin: the tangent of the winning ranks, averaged over ties.
  win = (x == y)
  num = c.collective_p.bind(jnp.where(win, t, jnp.zeros_like(t)),
                            **{**c.derive(params, "jvp"), "reduce": "sum"})
  cnt = c.collective_p.bind(win.astype(t.dtype), **{**c.derive(params, "jvpn"), "reduce": "sum"})
  return y, num / cnt


OP = c.register_op(c.OpDef("psum", "all_reduce", _abstract, _transpose, _batch, _jvp))


def _plan(reduce, api_name, mean=False):
  def plan(x, axis_name, *, axis_index_groups=None, key=None):
    if axis_index_groups is not None and reduce == "sum" and compat.check_vma_enabled():
      raise NotImplementedError(f"jax_dfccl.{api_name}: axis_index_groups under check_vma=True is not "
                                "supported (as in jax.lax); use shard_map(..., check_vma=False)")
    common, n, items, treedef = pl.leaves_of(x, f"p{reduce}", axis_name, key, api_name, axis_index_groups)
    if reduce != "sum":
      for leaf, _, _ in items:
        if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
          raise TypeError(f"jax_dfccl.{api_name}: complex inputs are not supported")
    post = (lambda y: y / n) if mean else None  # as jax.lax.pmean: the sum over the group size
    leaves = [pl.make_leaf(leaf, dict(op="psum", **common, key=k, key_hash=h, reduce=reduce, perm=()), post)
              for leaf, k, h in items]
    return pl.bucket(leaves, treedef)
  return plan


psum, psum_start = pl.api("psum", _plan("sum", "psum"))
pmean, pmean_start = pl.api("pmean", _plan("sum", "pmean", mean=True))
pmax, pmax_start = pl.api("pmax", _plan("max", "pmax"))
pmin, pmin_start = pl.api("pmin", _plan("min", "pmin"))

psum.__doc__ = """All-reduce (sum) over mesh axis/axes ``axis_name``; drop-in for ``jax.lax.psum``.

``x`` may be a pytree.  ``key`` names the collective across ranks (needed only
when ranks issue collectives from different code, e.g. rank-dependent branches);
by default it is derived from the op, shape, dtype, axes and call site."""
pmean.__doc__ = "All-reduce (mean: the sum divided by the group size); drop-in for ``jax.lax.pmean``."
pmax.__doc__ = "All-reduce (max); drop-in for ``jax.lax.pmax``. See :func:`psum`."
pmin.__doc__ = "All-reduce (min); drop-in for ``jax.lax.pmin``. See :func:`psum`."
