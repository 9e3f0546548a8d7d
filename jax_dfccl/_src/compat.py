"""Small shims over JAX internals that differ between the supported releases
(jax 0.11.2 and 0.12.0.1, the range pinned in pyproject.toml).  This is the one
place that knows about the installed release: what it has is detected here, once,
by feature (e.g. ``core.check_unreduced_args``, reduced/unreduced manual-axis
types), and the rest of the package calls these functions."""
from __future__ import annotations

from jax._src import config as jax_config
from jax._src import core


def check_vma_enabled() -> bool:
  return bool(jax_config._check_vma.value)


def _mat(aval):
  return getattr(aval, "manual_axis_type", None)


def varying(aval) -> frozenset:
  """The mesh axes over which ``aval`` varies (empty without check_vma)."""
  mat = _mat(aval)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", frozenset()))


def unreduced(aval) -> frozenset:
  """The mesh axes over which ``aval`` holds unreduced partial sums."""
  mat = _mat(aval)
  return frozenset(getattr(mat, "unreduced", ())) if mat is not None else frozenset()


def reduced(aval) -> frozenset:
  mat = _mat(aval)
  return frozenset(getattr(mat, "reduced", ())) if mat is not None else frozenset()


def state_of(aval, axes, api: str) -> str:
  """What ``aval`` is over ``axes``, as jax.lax sees it: 'varying', 'invarying',
  'unreduced' or 'reduced' (one of them for all the axes, else a ValueError)."""
  out = set()
  for a in axes:
    out.add("varying" if a in varying(aval) else "unreduced" if a in unreduced(aval)
            else "reduced" if a in reduced(aval) else "invarying")
  if len(out) > 1:
    raise ValueError(
        f"{api} can only accept axis_name which corresponds to one of varying, unreduced, "
        f"reduced or invarying state of the input. Got input type: {aval}, axes: {axes} "
        f"and input state: {out}")
  return out.pop()


def update_mat(aval, shape=None, **mat_entries):
  """``aval`` with a new shape and manual-axis state (varying=, unreduced=,
  reduced=), keeping its sharding/mesh."""
  shape = tuple(aval.shape if shape is None else shape)
  mat = _mat(aval)
  if mat is not None:
    if "unreduced" in mat_entries:
      mat_entries.setdefault("unreduced_kind", mat.unreduced_kind if mat_entries["unreduced"] else None)
    return aval.update(shape=shape, manual_axis_type=mat.update(
        **{k: (frozenset(v) if k != "unreduced_kind" else v) for k, v in mat_entries.items()}))
  return aval.update(shape=shape, vma=frozenset(mat_entries.get("varying", varying(aval))))


def with_shape_vma(aval, shape, vma):
  """``aval`` with a new shape and varying set, keeping its sharding/mesh."""
  return update_mat(aval, shape, varying=vma)


def check_unreduced_args(aval, axes, api: str):
  """jax.lax's refusal of inputs that are reduced/unreduced over ``axes``."""
  f = getattr(core, "check_unreduced_args", None)
  if f is not None and _mat(aval) is not None:
    f([aval], tuple(axes), api)


def pvary(x, axes):
  return core.pvary(x, tuple(axes))


def preduced(x, axes):
  from jax._src.lax import parallel
  return parallel.preduced(x, tuple(axes))
