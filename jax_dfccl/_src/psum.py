"""psum / pmax / pmin: all-reduce over one or more mesh axes (drop-in for jax.lax)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import docstrings as ds
from jax_dfccl._src import keys
from jax_dfccl._src import frontend
from jax_dfccl._src import plan as pl


def _abstract(aval, n, params):
  axes = set(params["axes"])
  if params.get("mode") == "unreduced":  # unreduced -> invariant (jax.lax's unreduced_psum)
    return compat.update_mat(aval, unreduced=compat.unreduced(aval) - axes)
  compat.check_unreduced_args(aval, params["axes"], "p" + params["reduce"])
  # Over the whole axis the result is the same on every rank (invariant); with
  # axis_index_groups it differs between groups and stays varying.
  vma = compat.varying(aval) if params["groups"] else compat.varying(aval) - axes
  return compat.with_shape_vma(aval, aval.shape, vma)


def _transpose(ct, params):
  if params["reduce"] != "sum":
    raise NotImplementedError("jax_dfccl: pmax/pmin are not linear")
  if params.get("mode") == "unreduced":
    return compat.preduced(ct, params["axes"])  # invariant -> reduced: no communication
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
    return y, c.collective_p.bind(t, **keys.derive(params, "jvp"))
  # pmax/pmin: the tangent of the winning ranks, averaged over ties.
  win = (x == y)
  num = c.collective_p.bind(jnp.where(win, t, jnp.zeros_like(t)),
                            **{**keys.derive(params, "jvp"), "reduce": "sum"})
  cnt = c.collective_p.bind(win.astype(t.dtype), **{**keys.derive(params, "jvpn"), "reduce": "sum"})
  return y, num / cnt


OP = c.register_op(c.OpDef("psum", "all_reduce", _abstract, _transpose, _batch, _jvp, split="elementwise"))


_SIGN = np.uint32(0x80000000)


def as_int32(x, reduce):
  """bool and uint32 inputs as jax.lax reduces them, in int32: a psum of bools
  counts them (int32 result, as jax.lax); uint32 sums wrap alike in int32 bits;
  uint32 max/min keep their order in int32 once the sign bit is flipped."""
  dt = np.dtype(x.dtype)
  if dt == np.bool_:
    return (x.astype(jnp.int32), None) if reduce == "sum" else (x.astype(jnp.int32), lambda y: y.astype(dt))
  if dt == np.uint32:
    flip = (lambda v: v) if reduce == "sum" else (lambda v: v ^ _SIGN)
    return (jax.lax.bitcast_convert_type(flip(x), jnp.int32),
            lambda y: flip(jax.lax.bitcast_convert_type(y, jnp.uint32)))
  return x, None


def as_reducible(x, reduce):
  """as_int32, and complex sums as sums of (real, imag) pairs (jax.lax sums complex values;
  their max/min stay refused below)."""
  if reduce == "sum" and jnp.issubdtype(x.dtype, jnp.complexfloating):
    return (jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1),
            lambda y: jax.lax.complex(y[..., 0], y[..., 1]))
  return as_int32(x, reduce)


def _plan(reduce, api_name, mean=False):
  def plan(x, axis_name, *, axis_index_groups=None, key=None):
    if axis_index_groups is not None and reduce == "sum" and compat.check_vma_enabled():
      raise NotImplementedError(f"jax_dfccl.{api_name}: axis_index_groups under check_vma=True is not "
                                "supported (as in jax.lax); use shard_map(..., check_vma=False)")
    xs, tdef = jax.tree.flatten(x)
    conv = [as_reducible(jnp.asarray(v), reduce) for v in xs]
    common, n, items, treedef = pl.leaves_of(jax.tree.unflatten(tdef, [v for v, _ in conv]), f"p{reduce}",
                                            axis_name, key, api_name, axis_index_groups)
    if reduce != "sum":
      for leaf, _, _ in items:
        if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
          raise TypeError(f"jax_dfccl.{api_name}: complex inputs are not supported")
    leaves = []
    for (leaf, k, h), (_, back) in zip(items, conv):
      mode = compat.state_of(jax.typeof(leaf), common["axes"], f"jax_dfccl.{api_name}")
      if mode == "unreduced" and axis_index_groups is not None:
        raise NotImplementedError(f"jax_dfccl.{api_name}: axis_index_groups with an unreduced input")
      # as jax.lax.pmean: the sum over the group size
      post = (lambda y, b=back: (b(y) if b else y) / n) if mean else back
      params = dict(op="psum", **common, key=k, key_hash=h, reduce=reduce, perm=())
      if mode == "unreduced":
        params["mode"] = mode
      leaves.append(pl.make_leaf(leaf, params, post))
    return pl.bucket(leaves, treedef)
  return plan


psum, psum_start = pl.api("psum", _plan("sum", "psum"))
pmean, pmean_start = pl.api("pmean", _plan("sum", "pmean", mean=True))
pmax, pmax_start = pl.api("pmax", _plan("max", "pmax"))
pmin, pmin_start = pl.api("pmin", _plan("min", "pmin"))
psum = frontend.route("psum", psum)
psum_start = frontend.route("psum", psum_start, start=True)
pmean = frontend.route("pmean", pmean)
pmean_start = frontend.route("pmean", pmean_start, start=True)
pmax = frontend.route("pmax", pmax)
pmax_start = frontend.route("pmax", pmax_start, start=True)
pmin = frontend.route("pmin", pmin)
pmin_start = frontend.route("pmin", pmin_start, start=True)



def _reduction_doc(name, what, lax_note, example):
  return f"""{what} over ``axis_name``; drop-in for ``jax.lax.{name}``.

  Args:
    x: an array or a pytree of arrays (each leaf reduced separately, leaves of one dtype
      in one collective); Python scalars are arrays too.
    {ds.AXIS_NAME}
    {ds.GROUPS}
    {ds.KEY}

  Returns:
    Arrays of ``x``'s shapes and dtypes (dtypes as ``jax.lax``: {lax_note}), the same on
    every rank of the group: invariant over ``axis_name`` under ``check_vma``.

  Raises:
    {ds.RAISES_AXIS}
    NotImplementedError: ``axis_index_groups`` of unequal sizes, or with ``check_vma=True``
      (psum, pmean), as ``jax.lax``.

  {ds.RUNTIME_ERROR}

  Example:
{example}
  """


def _example(call, out):
  return ds.example(call, out)


psum.__doc__ = _reduction_doc("psum", "Sums ``x``", "booleans are counted in int32",
                              _example('jax_dfccl.psum(v, "x")', "[28.]"))
pmean.__doc__ = _reduction_doc("pmean", "Averages ``x`` (the sum over the group size)",
                               "integers give floats", _example('jax_dfccl.pmean(v, "x")', "[3.5]"))
pmax.__doc__ = _reduction_doc("pmax", "Takes the maximum of ``x``", "complex inputs are refused",
                              _example('jax_dfccl.pmax(v, "x")', "[7.]"))
pmin.__doc__ = _reduction_doc("pmin", "Takes the minimum of ``x``", "complex inputs are refused",
                              _example('jax_dfccl.pmin(v, "x")', "[0.]"))
for _name, _out in (("psum", "[28.]"), ("pmean", "[3.5]"), ("pmax", "[7.]"), ("pmin", "[0.]")):
  globals()[_name + "_start"].__doc__ = ds.start_doc(_name, _example(
      f'jax_dfccl.done(jax_dfccl.{_name}_start(v, "x"))', _out))
