"""What every public collective does before its plan (:func:`route` wraps each one).

* An axis name bound by ``jax.vmap(..., axis_name=...)`` is not a mesh axis: its
  "ranks" are the elements of a batch on one device, nothing crosses devices and
  there is nothing to match by identity.  An op whose ``axis_name`` names only
  such axes is ``jax.lax``'s op (its batching rules, results and errors); the
  reductions over vmapped and mesh axes together reduce over the vmapped ones
  with ``jax.lax`` first, then over the mesh axes with jax_dfccl.  Other mixes,
  and the start forms over a vmapped axis, raise ``NotImplementedError``.
* The complex inputs of the blocking data-movement ops travel as (real,
  imaginary) float pairs (:func:`_as_pairs`): differentiable, where the int32
  words other dtypes travel as have no tangents.
* The start forms' inputs pass through :func:`no_tangent`: a handle is not
  differentiable, and an input carried as int32 words (complex, float8, the
  ragged header) would otherwise get a zero tangent without the start's rules
  being asked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import core

_REDUCTIONS = ("psum", "pmean", "pmax", "pmin")


def _batch_axis_names() -> set:
  """The axis names of the vmaps whose traces are open here (the current trace and its parents)."""
  names, tr = set(), core.trace_ctx.trace
  while tr is not None:
    name = getattr(getattr(tr, "axis_data", None), "name", None)
    if name is not None:
      names.add(name)
    tr = getattr(tr, "parent_trace", None)
  return names


def vmapped_axes(axis_name) -> tuple:
  """The axes of ``axis_name`` bound by an open ``jax.vmap(..., axis_name=...)``."""
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  env = core.get_axis_env()
  if not any(env.axis_exists(a) for a in axes):
    return ()
  batch = _batch_axis_names()
  return tuple(a for a in axes if a in batch)


@jax.custom_jvp
def _no_tangent(x):
  return x


@_no_tangent.defjvp
def _no_tangent_jvp(primals, tangents):
  raise NotImplementedError("jax_dfccl: start/done handles are not differentiable; "
                            "use the blocking form (e.g. jax_dfccl.psum) under autodiff")


def no_tangent(tree, all_inexact: bool = False):
  """``tree`` unchanged; differentiating through it raises NotImplementedError.  Applied to the
  inexact leaves that travel as int32 words (dtypes beyond the runtimes'), or to every inexact
  leaf with ``all_inexact``; the others reach the start primitive, whose rules refuse AD."""
  from jax_dfccl._src import core as c

  def guard(v):
    dt = jnp.result_type(v)
    if jnp.issubdtype(dt, jnp.inexact) and (all_inexact or dt not in c.SUPPORTED_DTYPES):
      return _no_tangent(v)
    return v
  return jax.tree.map(guard, tree)


_MOVEMENT = ("all_gather", "all_to_all", "ppermute", "pbroadcast")


def _as_pairs(x):
  """The complex leaves of ``x`` as (real, imaginary) pairs, and the inverse (None: none).  The
  data-movement ops carry other dtypes as int32 words, which have no tangents; the pairs are float
  arrays, moved together (one bucket) and differentiable."""
  leaves, tdef = jax.tree.flatten(x)
  cplx = [jnp.iscomplexobj(v) for v in leaves]
  if not any(cplx):
    return x, None
  parts = [(jnp.real(v), jnp.imag(v)) if c else v for v, c in zip(leaves, cplx)]

  def join(y):
    return jax.tree.unflatten(tdef, [jax.lax.complex(*v) if c else v for v, c in zip(y, cplx)])
  return parts, join


def route(name: str, ours, *, start: bool = False, axis_pos: int = 1):
  """``ours`` (a public op) that hands calls over vmapped axis names to ``jax.lax.<name>``."""
  lax_op = getattr(jax.lax, name)  # taken now: inside patch_lax() the attribute is ours
  @functools.wraps(ours)
  def f(*args, **kwargs):
    axis_name = kwargs["axis_name"] if "axis_name" in kwargs else (
        args[axis_pos] if len(args) > axis_pos else None)
    vm = vmapped_axes(axis_name) if axis_name is not None else ()
    if not vm:
      if start and args and not (isinstance(args[0], (int, float, complex))):
        args = (no_tangent(args[0], all_inexact=name == "ragged_all_to_all"), *args[1:])
      elif name in _MOVEMENT and args:
        x, join = _as_pairs(args[0])
        if join is not None:
          return join(ours(x, *args[1:], **kwargs))
      return ours(*args, **kwargs)
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    api = name + ("_start" if start else "")
    if start:
      raise NotImplementedError(f"jax_dfccl.{api}: the start forms do not take a vmapped axis name "
                                f"({', '.join(map(repr, vm))}); use jax_dfccl.{name}")
    if len(vm) == len(axes):  # nothing crosses devices: jax.lax's op and rules
      return lax_op(*args, **{k: v for k, v in kwargs.items() if k != "key"})
    if name in _REDUCTIONS and kwargs.get("axis_index_groups") is None and len(args) <= 2:
      rest = {k: v for k, v in kwargs.items() if k != "axis_name"}
      x = lax_op(args[0], vm)  # equal group sizes: the pmean of pmeans is the pmean
      return ours(x, tuple(a for a in axes if a not in vm), **rest)
    raise NotImplementedError(f"jax_dfccl.{name}: axis_name {axis_name!r} mixes vmapped axes {vm} with "
                              "mesh axes (supported for psum, pmean, pmax and pmin without "
                              "axis_index_groups)")
  return f
