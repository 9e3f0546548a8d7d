"""Collective identity at trace time: the key of a call (the user's, or one
derived from op, shape, dtype, axes and the call site) and its 64-bit hash, the
keys of derived collectives (tangents, transposes), and the warning for default
keys in branches that ranks may take differently."""
from __future__ import annotations

import hashlib
import itertools
import os
import sys
import warnings

import jax
from jax._src import core

from jax_dfccl._src import compat


def hash64(s: str) -> int:
  return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little", signed=True)


_PKG_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (sys.modules["jax_dfccl"], jax))
_SKIP = ("contextlib.py", "functools.py", "<frozen")


def call_site(depth: int = 3) -> str:
  """The innermost user frames (file basename:line:function), outside jax and jax_dfccl."""
  frames, f = [], sys._getframe(1)
  while f is not None and len(frames) < depth:
    fn = f.f_code.co_filename
    if not fn.startswith(_PKG_DIRS) and not fn.endswith(_SKIP) and "<frozen" not in fn:
      frames.append(f"{os.path.basename(fn)}:{f.f_lineno}:{f.f_code.co_name}")
    f = f.f_back
  return "<".join(frames) or "?"


_OCCURRENCES: dict[str, itertools.count] = {}


def make_key(opname: str, user_key, aval, axes, extra: str = "") -> tuple[str, int]:
  """(readable key, 64-bit identity).  A user key is the identity itself, so
  ranks that disagree on shapes under one key get a mismatch error."""
  if user_key is not None:
    if not isinstance(user_key, str) or not user_key:
      raise TypeError(f"jax_dfccl: key must be a non-empty string, got {user_key!r}")
    return user_key + extra, hash64("user:" + user_key + extra)
  site = call_site()
  _warn_if_in_rank_dependent_branch(opname, site, axes)
  ident = f"{opname}|{site}|{tuple(aval.shape)}|{aval.dtype}|{tuple(axes)}{extra}"
  # The k-th collective traced from one call site gets occurrence k: ops issued
  # from one line (a Python loop, a helper called twice) stay distinct, since
  # XLA may run independent custom calls in a different order on each device.
  k = next(_OCCURRENCES.setdefault(ident, itertools.count()))
  readable = f"{opname}@{site}{extra}" + (f"#{k}" if k else "")
  return readable, hash64(f"{ident}#{k}")


class DefaultKeyInBranchWarning(UserWarning):
  """A collective with a default key inside a branch that ranks may choose differently."""


_BRANCH_FRAMES = {"_switch_internal": "index", "cond": "pred"}  # jax/_src/lax/control_flow/conditionals.py


def _warn_if_in_rank_dependent_branch(opname, site, axes):
  """Default keys name the call site, so the same collective issued from different
  branches of a ``lax.switch``/``lax.cond`` has a different key on ranks that took
  different branches: they would wait for each other until ``config.timeout_s``.
  Say so at trace time when the branch index may differ between the ranks of the
  group (it varies over one of ``axes``, or check_vma is off and no one can tell)."""
  f = sys._getframe(2)
  while f is not None:
    var = _BRANCH_FRAMES.get(f.f_code.co_name)
    if var and f.f_code.co_filename.endswith("conditionals.py") and var in f.f_locals:
      idx = f.f_locals[var]
      if isinstance(idx, core.Tracer) and (
          not compat.check_vma_enabled() or compat.varying(jax.typeof(idx)) & set(axes)):
        warnings.warn(
            f"jax_dfccl.{opname} at {site} is inside a lax.switch/lax.cond whose branch index may "
            f"differ between the ranks of axes {tuple(axes)}, without key=: default keys differ per "
            "branch, so ranks in different branches would never match and fail only after "
            "config.timeout_s. Give the collectives of the branches the same key= (e.g. key='step/grad').",
            DefaultKeyInBranchWarning, stacklevel=2)
      return
    f = f.f_back


def derive(params: dict, tag: str) -> dict:
  """Params of a collective derived from another (JVP tangent, transpose)."""
  p = dict(params)
  p["key"] = f"{params['key']}/{tag}"
  p["key_hash"] = hash64(f"{params['key_hash']}/{tag}")
  return p
