"""Plans: from a public call's arguments to the collectives it binds, and back.

A plan (one per op module) validates the arguments, flattens the pytree and
builds one :class:`Leaf` per array: its canonical input (the flat-buffer layout
of ``xla_ffi/include/dfccl/collective.h``), the collective's params and a
post-processing step back to ``jax.lax``'s result.  Here: the shared front half
(:func:`leaves_of`), dtypes beyond the runtimes' own (:func:`make_leaf`),
buckets of leaves (:func:`bucket`), and the blocking and start/done forms built
from a plan (:func:`api`, :func:`done`).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_dfccl._src import compat
from jax_dfccl._src import core as c
from jax_dfccl._src import order
from jax_dfccl._src import keys

# Beyond the runtimes' dtypes: the data-movement ops (all_gather, all_to_all,
# ppermute) carry any other dtype as its bytes in int32 words, and reductions of
# small integers run in int32 and are cast back (the same wraparound as jax.lax).
SMALL_INTS = tuple(np.dtype(d) for d in (np.int8, np.uint8, np.int16, np.uint16))


def check_dtype(x, api: str, movement: bool = False):
  dt = np.dtype(jnp.result_type(x))
  # kind "V": ml_dtypes' (float8, int4, ...), the only void-kind dtypes a JAX array holds.
  if dt in c.SUPPORTED_DTYPES or (movement and dt.kind in "biufcV") or (not movement and dt in SMALL_INTS):
    return
  extra = "any fixed-width dtype" if movement else ", ".join(str(d) for d in SMALL_INTS)
  raise TypeError(f"jax_dfccl.{api}: unsupported dtype {dt}; supported: "
                  + ", ".join(str(d) for d in c.SUPPORTED_DTYPES) + ", " + extra)


def _to_words(x, lead: int):
  """x -> (int32 words of shape x.shape[:lead] + (w,), inverse).  The inverse takes
  words with any leading dims L (e.g. all_gather's added group dim) to L + x.shape[lead:]."""
  dt, rest = np.dtype(x.dtype), x.shape[lead:]
  if dt.kind == "c":  # as (real, imag) pairs
    words, back_pairs = _to_words(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1), lead)
    return words, lambda y: (lambda v: jax.lax.complex(v[..., 0], v[..., 1]))(back_pairs(y))
  b, m = dt.itemsize, int(np.prod(rest, dtype=np.int64))
  u8 = x.astype(jnp.uint8) if dt == np.bool_ else jax.lax.bitcast_convert_type(x, jnp.uint8)
  u8 = u8.reshape(x.shape[:lead] + (m * b,))
  pad = -(m * b) % 4
  u8 = jnp.pad(u8, [(0, 0)] * lead + [(0, pad)])
  words = jax.lax.bitcast_convert_type(u8.reshape(x.shape[:lead] + ((m * b + pad) // 4, 4)), jnp.int32)

  def back(y):
    lead_out = y.shape[:-1]
    v = jax.lax.bitcast_convert_type(y, jnp.uint8).reshape(lead_out + (-1,))[..., : m * b]
    if dt == np.bool_:
      return v.reshape(lead_out + rest).astype(dt)
    v = v.reshape(lead_out + rest + ((b,) if b > 1 else ()))
    return jax.lax.bitcast_convert_type(v, dt)
  return words, back




@dataclasses.dataclass
class Leaf:
  """One array's part of a collective: canonical input, post-processing, and
  for an op whose output starts from the caller's values, those (`init`)."""
  x: Any
  params: dict
  post: Callable = lambda y: y
  init: tuple = ()


def make_leaf(x, params: dict, post: Callable | None = None, *, lead: int = 0) -> Leaf:
  """The Leaf of canonical input `x`: dtypes beyond the runtimes' travel as int32
  (bytes for data movement, `lead` leading dims kept; values for small-integer
  reductions), converted back before `post`."""
  post = post or (lambda y: y)
  dt = np.dtype(x.dtype)
  if dt in c.SUPPORTED_DTYPES:
    return Leaf(x, params, post)
  if c.reduces(params["op"]):
    return Leaf(x.astype(jnp.int32), params, lambda y: post(y.astype(dt)))
  words, back = _to_words(x, lead)
  return Leaf(words, params, lambda y: post(back(y)))


class Assemble:
  """Builds the result pytree from the leaves' outputs: leaf j's output goes to
  result position slots[j] (an int), or, for a bucket, its post returns a tuple
  for the positions slots[j] (a tuple)."""

  def __init__(self, treedef, slots):
    self.treedef, self.slots = treedef, slots

  def __call__(self, outs):
    flat = [None] * self.treedef.num_leaves
    for out, sl in zip(outs, self.slots):
      for i, v in (zip(sl, out) if isinstance(sl, tuple) else ((sl, out),)):
        flat[i] = v
    return jax.tree.unflatten(self.treedef, flat)


def _assemble(treedef, outs):
  return treedef(outs) if isinstance(treedef, Assemble) else jax.tree.unflatten(treedef, outs)


# Ops whose canonical input leads with the group dim (its rows stay apart in a bucket).
_ROWS_IN = ("psum_scatter", "all_to_all")


def bucket(leaves: Sequence[Leaf], treedef):
  """Several leaves of one dtype (and varying axes) become one collective over
  their concatenation (along the rows of the canonical form: one rendezvous and
  one transfer instead of one per leaf).  Returns (leaves, Assemble or treedef)."""
  groups: dict = {}
  for i, lf in enumerate(leaves):
    groups.setdefault((np.dtype(lf.x.dtype), frozenset(compat.varying(jax.typeof(lf.x)))), []).append(i)
  if all(len(g) == 1 for g in groups.values()):
    return leaves, treedef
  lead_in = 1 if leaves[0].params["op"] in _ROWS_IN else 0
  out, slots = [], []
  for idx in groups.values():
    if len(idx) == 1:
      out.append(leaves[idx[0]])
      slots.append(idx[0])
      continue
    parts = [leaves[i] for i in idx]
    rows = [p.x.reshape(p.x.shape[:lead_in] + (-1,)) for p in parts]
    offs = np.cumsum([0] + [r.shape[-1] for r in rows])
    params = dict(parts[0].params, key=f"{parts[0].params['key']}+{len(parts) - 1}",
                  key_hash=keys.hash64("bucket:" + ",".join(str(p.params["key_hash"]) for p in parts)))

    def post(y, parts=parts, offs=offs):  # y: the output's leading dims, then the concatenated rows
      return tuple(p.post(y[..., offs[j]:offs[j + 1]].reshape(y.shape[:-1] + p.x.shape[lead_in:]))
                   for j, p in enumerate(parts))
    out.append(Leaf(jnp.concatenate(rows, axis=-1), params, post))
    slots.append(tuple(idx))
  return out, Assemble(treedef, slots)


def run_blocking(leaves: Sequence[Leaf], treedef):
  return _assemble(treedef, [lf.post(order.bind_blocking(c.collective_p, lf.x, *lf.init, **lf.params))
                             for lf in leaves])


class _HandleState:
  __slots__ = ("names", "posts", "treedef", "keys", "sites", "routes", "consumed")

  def __init__(self, names, posts, treedef, keys, sites, routes=None):
    self.names, self.posts, self.treedef = names, posts, treedef
    self.keys, self.sites, self.consumed = keys, sites, False
    self.routes = routes if routes is not None else [None] * len(sites)  # each done's route parameter


@jax.tree_util.register_pytree_node_class
class Handle:
  """An in-flight collective returned by a ``*_start`` function.

  Pass it to :func:`jax_dfccl.done` exactly once, in the same traced program.
  """

  def __init__(self, arrays, state: _HandleState):
    self._arrays = tuple(arrays)
    self._state = state

  def tree_flatten(self):
    return self._arrays, self._state

  @classmethod
  def tree_unflatten(cls, state, arrays):
    return cls(arrays, state)

  def done(self):
    """``jax_dfccl.done(self)``; also the method of jax.lax's async futures
    (``jax.lax.psum_scatter_start(...).done()``), so patch_lax can swap those."""
    return done(self)

  def __repr__(self):
    return f"Handle({', '.join(self._state.keys)}{', done' if self._state.consumed else ''})"


def run_start(name: str, leaves: Sequence[Leaf], treedef) -> Handle:
  arrays, sites = [], []
  for lf in leaves:
    site = c.CallSite(next(c._SITES))
    arrays.extend(c.start_p.bind(lf.x, *lf.init, site=site, **lf.params))
    order.issued(arrays[-1], wait=False)  # its ticket
    sites.append(site)
  return Handle(arrays, _HandleState(name, [lf.post for lf in leaves], treedef,
                                     [lf.params["key"] for lf in leaves], sites,
                                     [c.route_of(lf.params) for lf in leaves]))


def done(handle: Handle):
  """Waits for a started collective; returns exactly what the blocking form returns."""
  if not isinstance(handle, Handle):
    raise TypeError(f"jax_dfccl.done expects a handle from a *_start function, got {type(handle)}")
  st = handle._state
  if st.consumed:
    raise ValueError(f"jax_dfccl.done: handle of {st.names} ({', '.join(st.keys)}) is already done")
  st.consumed = True
  for site in st.sites:
    site.done = True
  outs = []
  for i, (post, key, site, route) in enumerate(zip(st.posts, st.keys, st.sites, st.routes)):
    outs.append(post(order.bind_wait(c.done_p, *handle._arrays[3 * i: 3 * i + 3], key=key, site=site,
                                     route=route)))
  return _assemble(st.treedef, outs)


def _bind(sig: inspect.Signature, public: str, args, kwargs):
  """The call's arguments checked against the public signature; a wrong or
  missing argument is a TypeError naming the public function."""
  try:
    sig.bind(*args, **kwargs)
  except TypeError as e:
    raise TypeError(f"jax_dfccl.{public}(): {e}") from None


def api(name: str, plan: Callable):
  """Builds the blocking and the start form of a public collective from its plan;
  both have the plan's signature (jax.lax's parameters plus ``key=``), which
  ``inspect.signature`` and IDEs show."""
  sig = inspect.signature(plan)

  def blocking(*args, **kwargs):
    _bind(sig, name, args, kwargs)
    leaves, treedef = plan(*args, **kwargs)
    return run_blocking(leaves, treedef)

  def start(*args, **kwargs):
    _bind(sig, name + "_start", args, kwargs)
    leaves, treedef = plan(*args, **kwargs)
    return run_start(name, leaves, treedef)

  blocking.__name__, start.__name__ = name, name + "_start"
  blocking.__qualname__, start.__qualname__ = name, name + "_start"
  blocking.__signature__ = start.__signature__ = sig
  blocking.__module__ = start.__module__ = "jax_dfccl"
  start.__doc__ = (f"Starts :func:`jax_dfccl.{name}` and returns a handle; "
                   f"``jax_dfccl.done(handle)`` returns its result.")
  return blocking, start


def as_groups(axis_index_groups, n: int, api: str):
  """Validated axis_index_groups (tuple of tuples of axis indices) or None."""
  if axis_index_groups is None:
    return None
  try:
    groups = tuple(tuple(int(i) for i in g) for g in axis_index_groups)
  except TypeError:
    raise TypeError(f"jax_dfccl.{api}: axis_index_groups must be a list of lists of axis indices, "
                    f"got {axis_index_groups!r}") from None
  if sorted(i for g in groups for i in g) != list(range(n)):
    raise ValueError(f"jax_dfccl.{api}: axis_index_groups {axis_index_groups!r} must hold every "
                     f"index of the axis (0..{n - 1}) exactly once")
  if len({len(g) for g in groups}) != 1:
    raise NotImplementedError(f"jax_dfccl.{api}: axis_index_groups of unequal sizes are not supported")
  return groups


def leaves_of(x, opname, axis_name, key, api_name, axis_index_groups=None, movement=False):
  """Common front half of every plan: validate, flatten, make keys.  Returns the
  params every leaf shares (axes, groups), the group size, (leaf, key, hash) per
  leaf and the treedef."""
  axes = c.as_axes(axis_name)
  n = c.group_size(axes, api_name)
  groups = as_groups(axis_index_groups, n, api_name)
  if groups:
    n = len(groups[0])
  xs, treedef = jax.tree.flatten(x)
  out = []
  for i, leaf in enumerate(xs):
    check_dtype(leaf, api_name, movement)
    leaf = c.make_varying(jnp.asarray(leaf), axes)
    extra = (f"[{i}]" if len(xs) > 1 else "") + (f"|groups{groups}" if groups else "")
    k, h = keys.make_key(opname, key, jax.typeof(leaf), axes, extra)
    out.append((leaf, k, h))
  return dict(axes=axes, groups=groups), n, out, treedef
