"""Loads the runtimes and registers their FFI targets with XLA.

``_dfccl_cpu`` is always loaded; ``_dfccl_cuda`` only when JAX sees NVIDIA GPUs
(importing it never touches CUDA otherwise).
"""
from __future__ import annotations

import contextlib
import importlib
import threading

import jax

from jax_dfccl.config import config

_lock = threading.Lock()
_runtimes: dict[str, object] = {}  # platform -> extension module
_loaded = False


def _gpu_present() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices("gpu"))
  except RuntimeError:
    return False


def load() -> dict:
  global _loaded
  with _lock:
    if _loaded:
      return _runtimes
    cpu = importlib.import_module("jax_dfccl._dfccl_cpu")
    for name, capsule in cpu.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    _runtimes["cpu"] = cpu
    if _gpu_present():
      try:
        cuda = importlib.import_module("jax_dfccl._dfccl_cuda")
      except ImportError as e:
        raise ImportError("jax_dfccl: JAX sees GPUs but the CUDA backend (_dfccl_cuda) is not "
                          "built; reinstall jax_dfccl on a machine with nvcc") from e
      if cuda.op_table() != cpu.op_table():
        raise ImportError("jax_dfccl: the CPU and CUDA extension modules were built from different "
                          "op tables; rebuild jax_dfccl")
      for name, capsule in cuda.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
      _runtimes["cuda"] = cuda
    for rt in _runtimes.values():
      rt.configure(config.as_dict())
    _loaded = True
    return _runtimes


def op_table() -> dict:
  """The runtimes' op, reduce-op and dtype tables (xla_ffi/include/dfccl/ops.h).
  Importing the CPU module registers nothing and touches no device."""
  return importlib.import_module("jax_dfccl._dfccl_cpu").op_table()


def runtimes() -> dict:
  return load()


def configure(**entries):
  """Updates ``jax_dfccl.config`` and pushes it to the loaded runtimes."""
  for k, v in entries.items():
    if not hasattr(config, k):
      raise AttributeError(f"jax_dfccl.configure: unknown entry {k!r}; see jax_dfccl.config")
    setattr(config, k, type(getattr(config, k))(v))
  for rt in load().values():
    rt.configure(config.as_dict())


@contextlib.contextmanager
def configured(**entries):
  """``configure(**entries)`` inside the block, the previous values restored
  after it (also on an error).  Settings read at trace time (the ``overlap_*``
  entries) apply to what is traced inside the block."""
  old = {}
  for k in entries:
    if not hasattr(config, k):
      raise AttributeError(f"jax_dfccl.configured: unknown entry {k!r}; see jax_dfccl.config")
    old[k] = getattr(config, k)
  configure(**entries)
  try:
    yield config
  finally:
    configure(**old)


def stats() -> dict:
  """Runtime counters per backend ({'cpu': {...}, 'cuda': {...}})."""
  return {p: dict(rt.stats()) for p, rt in load().items()}


def pending(wait_ms: int = 1000) -> str:
  """What the runtimes hold in flight right now, per backend: every collective
  instance with its key and sequence number and which ranks started it (GPU:
  also whether this device's stream reached it, and what the daemon and the
  copy-engine mover are doing).  For a program that seems stuck: call it from
  another thread.  The GPU report tries the runtime lock for ``wait_ms``."""
  parts = [f"[{p}]\n{r}" for p, rt in load().items() if (r := rt.pending(wait_ms))]
  return "\n".join(parts) if parts else "no collective in flight\n"


def reset():
  """Drops failed/in-flight runtime state (after an injected fault)."""
  for rt in load().values():
    rt.reset()
