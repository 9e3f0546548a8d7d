"""patch_lax(): existing ``jax.lax`` collective code, traced on jax_dfccl.

Inside ``with jax_dfccl.patch_lax():`` the collectives of the ``jax.lax`` module
(``psum``, ``pmean``, ``pmax``, ``pmin``, ``all_gather``, ``psum_scatter``,
``all_to_all``, ``ppermute``, ``pshuffle``, ``pbroadcast``, ``ragged_all_to_all``, and the async ``psum_scatter_start``
of jax 0.12 (and any other ``*_start`` the installed ``jax.lax`` exports: their
handles have jax's ``.done()``) are jax_dfccl's, so a model or library that calls
``jax.lax.psum`` (or ``lax.psum`` after ``from jax import lax``) gets order-free
collectives without edits.  It applies to what is *traced* inside the block
(a function jitted and traced before keeps its compiled collectives), and,
since it rebinds module attributes, to every thread of the process while the
block runs.  Python scalars keep ``jax.lax``'s behaviour (``lax.psum(1, axis)``
is the axis size, computed without communication); ``axis_index_groups`` are
passed on (groups of unequal sizes raise ``NotImplementedError``).
"""
from __future__ import annotations

import operator
import threading

import jax
import numpy as np

from jax_dfccl._src import all_gather as _ag
from jax_dfccl._src import all_to_all as _a2a
from jax_dfccl._src import pbroadcast as _pb
from jax_dfccl._src import ppermute as _pp
from jax_dfccl._src import psum as _ps
from jax_dfccl._src import psum_scatter as _rs
from jax_dfccl._src import ragged_all_to_all as _ra

_lock = threading.Lock()
_depth = 0
_originals: dict = {}


def _python_scalars(x) -> bool:
  leaves = jax.tree.leaves(x)
  return bool(leaves) and all(isinstance(v, (int, float, bool, complex, np.number)) for v in leaves)


def _reduction(name, ours):
  def f(x, axis_name, *, axis_index_groups=None):
    if _python_scalars(x):  # constants: no communication, as jax.lax does it
      return _originals[name](x, axis_name, axis_index_groups=axis_index_groups)
    return ours(x, axis_name, axis_index_groups=axis_index_groups)
  f.__name__ = name
  return f


def _pshuffle(x, axis_name, perm):  # output at index i comes from index perm[i]
  if set(perm) != set(range(len(perm))):
    raise ValueError(f"`perm` does not represent a permutation: {perm}")
  return _pp.ppermute(x, axis_name, list(zip(perm, range(len(perm)))))


def _pbroadcast(x, axis_name, source):
  try:
    source = operator.index(source)
  except TypeError:  # a traced source: jax.lax's documented definition, on our psum
    import jax.numpy as jnp
    return jax.tree.map(lambda v: _ps.psum(jnp.where(jax.lax.axis_index(axis_name) == source, v,
                                                     jnp.zeros_like(v)), axis_name), x)
  return _pb.pbroadcast(x, axis_name, source)


_REPLACEMENTS = {
    "psum": _reduction("psum", _ps.psum),
    "pmax": _reduction("pmax", _ps.pmax),
    "pmin": _reduction("pmin", _ps.pmin),
    "pmean": _reduction("pmean", _ps.pmean),
    # jax.lax's signatures (plus key=): bound as they are.
    "all_gather": _ag.all_gather,
    "psum_scatter": _rs.psum_scatter,
    "all_to_all": _a2a.all_to_all,
    "ppermute": _pp.ppermute,
    "pshuffle": _pshuffle,
    "pbroadcast": _pbroadcast,
    "ragged_all_to_all": _ra.ragged_all_to_all,  # same signature
}
# jax 0.12's async forms (futures with .done()), where the installed jax.lax has them.
_ASYNC = {"psum_scatter_start": _rs.psum_scatter_start, "psum_start": _ps.psum_start,
          "all_gather_start": _ag.all_gather_start, "all_to_all_start": _a2a.all_to_all_start,
          "ppermute_start": _pp.ppermute_start}
_REPLACEMENTS.update({k: v for k, v in _ASYNC.items() if hasattr(jax.lax, k)})


class patch_lax:
  """Traces the collectives of ``jax.lax`` on jax_dfccl within a ``with`` block.

  Inside the block, ``jax.lax.psum``, ``pmean``, ``pmax``, ``pmin``, ``all_gather``,
  ``psum_scatter``, ``all_to_all``, ``ppermute``, ``pshuffle``, ``pbroadcast`` and
  ``ragged_all_to_all`` (and the ``*_start`` forms the installed ``jax.lax`` has)
  are jax_dfccl's, so code written against ``jax.lax`` (a model, a library) gets
  order-free collectives without edits.  It applies to what is traced inside the
  block; blocks nest, and the patch is process-wide (every thread) while one is open.

  The object is a plain context manager: ``__enter__`` patches and the matching
  ``__exit__`` restores (entered by hand, ``cm = patch_lax(); cm.__enter__()``, the
  patch stays until ``cm.__exit__(None, None, None)``, whether or not ``cm`` is
  still referenced).  One object is entered at most once at a time.

  Returns:
    A context manager; ``with patch_lax() as p`` binds ``p`` to it.

  Raises:
    RuntimeError: when an object already entered is entered again, or one not
      entered is exited.

  Example:
    >>> mesh = jax.sharding.Mesh(jax.devices(), ("x",))
    >>> def total(v):  # unmodified jax.lax code
    ...   return jax.lax.psum(v, "x")
    >>> f = jax.jit(jax.shard_map(total, mesh=mesh, in_specs=P("x"), out_specs=P()))
    >>> with jax_dfccl.patch_lax():
    ...   print("dfccl_start" in f.lower(jnp.arange(8.0)).as_text(), f(jnp.arange(8.0)))
    True [28.]
  """

  def __init__(self):
    self._entered = False

  def __enter__(self):
    global _depth
    with _lock:
      if self._entered:
        raise RuntimeError("jax_dfccl.patch_lax: this object is already entered; use a new "
                           "patch_lax() for a nested block")
      if _depth == 0:
        for name, f in _REPLACEMENTS.items():
          _originals[name] = getattr(jax.lax, name)
          setattr(jax.lax, name, f)
      _depth += 1
      self._entered = True
    return self

  def __exit__(self, *exc_info):
    global _depth
    with _lock:
      if not self._entered:
        raise RuntimeError("jax_dfccl.patch_lax: __exit__ without a matching __enter__ on this object")
      self._entered = False
      _depth -= 1
      if _depth == 0:
        for name, f in _originals.items():
          setattr(jax.lax, name, f)
        _originals.clear()
    return False

  def __repr__(self):
    return f"patch_lax({'entered' if self._entered else 'not entered'})"
