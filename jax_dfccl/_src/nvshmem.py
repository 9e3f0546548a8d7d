"""NVSHMEM, the engine under the cross-host transport (``docs/design/scale-out.md``).

What is built: the module ``_dfccl_nvshmem`` (where the build found NVSHMEM:
``CMakeLists.txt``), NVSHMEM's set-up through the job's key-value store, and the
transport check — protocol C (``xla_ffi/transport/announce.cuh``) over NVSHMEM and
over direct stores on every process at once; and the daemon compiled over NVSHMEM, which
``jax_dfccl.initialize`` puts under groups spanning hosts (``jax_dfccl._src.distributed``).

Set-up (:func:`initialize`) is NVSHMEM's unique-id bootstrap, as XLA's own NVSHMEM
path does it: process 0 makes the id, the ``jax.distributed`` key-value store
carries it, every process joins as the PE of its process index.  One PE per
process, outside any execution.  The environment NVSHMEM reads is the user's (for
one host: ``NVSHMEM_REMOTE_TRANSPORT=none``; across hosts its IB or libfabric
transport; ``NVSHMEM_SYMMETRIC_SIZE`` for the symmetric heap).
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.util
import pathlib
import threading

import jax

_NS = "jax_dfccl/nvshmem"
_lock = threading.Lock()
_state: dict = {"module": None, "why": "", "inits": 0, "status": ""}


def _library_dir() -> pathlib.Path | None:
  try:
    import nvidia.nvshmem as m  # the wheel nvidia-nvshmem-cu13 (a namespace package)
  except ImportError:
    return None
  for p in m.__path__:
    lib = pathlib.Path(p) / "lib"
    if any(lib.glob("libnvshmem_host.so*")):
      return lib
  return None


def load():
  """The module ``_dfccl_nvshmem``; raises ImportError saying why it cannot be had."""
  with _lock:
    if _state["module"] is not None:
      return _state["module"]
    if _state["why"]:
      raise ImportError(_state["why"])
    lib = _library_dir()
    try:
      if lib is not None:  # its host library by the wheel's path (the module's run path may not be it)
        ctypes.CDLL(str(sorted(lib.glob("libnvshmem_host.so*"))[0]), mode=ctypes.RTLD_GLOBAL)
      mod = importlib.import_module("jax_dfccl._dfccl_nvshmem")
    except (ImportError, OSError) as e:
      if importlib.util.find_spec("jax_dfccl._dfccl_nvshmem") is None:
        _state["why"] = ("jax_dfccl: built without NVSHMEM (no _dfccl_nvshmem: install nvidia-nvshmem-cu13 "
                         "before building, or set NVSHMEM_HOME)")
      else:
        _state["why"] = (f"jax_dfccl: _dfccl_nvshmem does not load ({e}); it needs NVSHMEM's host library "
                         "(pip install nvidia-nvshmem-cu13)")
      raise ImportError(_state["why"]) from None
    if mod.loaded_version() != mod.built_version():
      _state["why"] = (f"jax_dfccl: _dfccl_nvshmem was built with NVSHMEM {mod.built_version()}, this process "
                       f"loads {mod.loaded_version()} (pip install nvidia-nvshmem-cu13=={mod.built_version()})")
      raise ImportError(_state["why"])
    _state["module"] = mod
    return mod


def available() -> tuple[bool, str]:
  """(True, "") when the NVSHMEM module loads here, else (False, why)."""
  try:
    load()
    return True, ""
  except ImportError as e:
    return False, str(e)


def initialize(timeout_s: float = 120.0, device: int = -1) -> str:
  """Joins every process of the ``jax.distributed`` job to one NVSHMEM job (collective).

  Process 0 makes NVSHMEM's unique id and puts it into the job's key-value store;
  every process reads it and joins as the PE of its process index.  Call it in
  every process, after ``jax.distributed.initialize``, outside any execution.
  ``device``: the CUDA ordinal of the PE's GPU (-1: the module's current one).

  Returns:
    NVSHMEM's init status (``"FULL_MPG"``, ``"IS_INITIALIZED"``, ...).

  Raises:
    ImportError: no NVSHMEM module here (:func:`available` says why).
    RuntimeError: the key-value store did not answer within ``timeout_s``, or NVSHMEM
      failed to initialise (the message says which PE and how).
  """
  mod = load()
  from jax_dfccl._src.distributed import _client
  client = _client()
  with _lock:
    if mod.initialized():
      return _state["status"]
    _state["inits"] += 1  # every process counts its set-ups alike: a key per set-up
    key = f"{_NS}/uid/{_state['inits']}"
  status = _join(mod, client, jax.process_index(), jax.process_count(), key, int(timeout_s * 1000), device)
  _state["status"] = status
  return status


def _join(mod, client, rank: int, n: int, key: str, timeout_ms: int, device: int = -1) -> str:
  """The bootstrap of one process: process 0 publishes the unique id under `key`, every
  process (0 included) reads it back and joins as PE `rank` of `n`."""
  if rank == 0:
    client.key_value_set_bytes(key, mod.unique_id())
  uid = client.blocking_key_value_get_bytes(key, timeout_ms)
  return mod.init(uid, rank, n, device)


def finalize() -> None:
  """Leaves the NVSHMEM job (collective); a no-op when not initialised."""
  if _state["module"] is not None:
    _state["module"].finalize()


def check_transport(blocks: int = 40, per_block: int = 8, msg_bytes: int = 64, slots: int = 3,
                    mismatch_every: int = 5, pingpong: int = 2000, seed: int = 1, timeout_s: float = 10.0,
                    store: bool = True, ranks_per_host: int = 0, delay_us: float = 0.0) -> list[dict]:
  """Protocol C over NVSHMEM (and over direct stores where every PE has a peer address) on
  every process at once (collective, after :func:`initialize`).

  ``blocks`` blocks of ``per_block`` instances (keys 1, 2, ...), each block started in an
  order of each process's own on ``slots`` receive slots; each instance the sum of every
  rank's ``msg_bytes`` message, checked on the device against the reference; every key
  divisible by ``mismatch_every`` has another signature on the last rank, which every rank
  must fail naming it; the (cap+1)-th start refused at once; then ``pingpong`` round trips of
  an 8-byte put with a signal between processes 0 and 1.  A test setting simulates hosts: with
  ``ranks_per_host`` > 0, consecutive processes form a "host", and each put to another host
  waits ``delay_us`` first (the network's latency).

  Returns:
    One dict per transport: ``transport``, ``skipped`` (why not run, or ""), ``ok`` (sums equal to
    the reference), ``failed_as_expected``, ``wrong``, ``cap_refused``, ``first_error``,
    ``seconds``, ``round_trip_us`` (process 0).
  """
  return load().check(blocks, per_block, msg_bytes, slots, mismatch_every, pingpong, seed, timeout_s, store,
                      ranks_per_host, delay_us)


def native_collective(op: str, sizes: list[int], iters: int = 20, reps: int = 5) -> list[dict]:
  """NVSHMEM's own collective ``op`` on a CUDA stream of this process's PE: the peer this
  library's collectives are measured against (collective, after :func:`initialize`).

  ``op``: ``"psum"`` (``nvshmemx_float_sum_reduce_on_stream``), ``"all_gather"`` (fcollect) or
  ``"all_to_all"`` (alltoall), float32 on every PE; ``sizes``: each PE's input in bytes. Each size
  is checked once against the exact reference, then timed: ``iters`` calls back to back between
  CUDA events, ``reps`` times.

  Returns:
    One dict per size: ``bytes``, ``exact``, ``max_err``, ``us`` (per call, one per rep).
  """
  return load().native(op, [int(s) for s in sizes], iters, reps)
