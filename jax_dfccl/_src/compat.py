"""Small shims over JAX internals that differ between the supported releases
(jax 0.11.2 and 0.12.x)."""
from __future__ import annotations

from jax._src import config as jax_config
from jax._src import core


def check_vma_enabled() -> bool:
  return bool(jax_config._check_vma.value)


def varying(aval) -> frozenset:
  """The mesh axes over which ``aval`` varies (empty without check_vma)."""
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", frozenset()))


def with_shape_vma(aval, shape, vma):
  """``aval`` with a new shape and varying set, keeping its sharding/mesh."""
  if hasattr(aval, "manual_axis_type"):
    return aval.update(shape=tuple(shape),
                       manual_axis_type=aval.manual_axis_type.update(varying=frozenset(vma)))
  return aval.update(shape=tuple(shape), vma=frozenset(vma))


def pvary(x, axes):
  return core.pvary(x, tuple(axes))
