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
                          "built: reinstall jax_dfccl on a machine with nvcc and an NVIDIA driver, or "
                          "build it anywhere with nvcc: pip install . -Ccmake.define.DFCCL_ENABLE_CUDA=ON") from e
      if cuda.op_table() != cpu.op_table():
        raise ImportError("jax_dfccl: the CPU and CUDA extension modules were built from different "
                          "op tables; rebuild jax_dfccl")
      for name, registration in cuda.types().items():  # (the states some targets' stages share)
        jax.ffi.register_ffi_type(name, registration, platform="CUDA")
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
  """Sets entries of ``jax_dfccl.config`` by their flat names and pushes them to the runtimes.

  Every entry goes to the loaded runtimes (loading them first), so the change
  holds in the runtimes before this returns; ``config.<section>.<entry> = value``
  comes here too.

  Args:
    **entries: entries of :class:`jax_dfccl.config` by flat name (e.g. ``timeout_s=60.0``);
      values are converted to the entry's type.

  Returns:
    None.

  Raises:
    AttributeError: an unknown entry.
    ValueError: a value a runtime rejects (out of its range); every entry, in Python and
      in the runtimes, is left as it was.

  Example:
    >>> jax_dfccl.configure(timeout_s=60)
    >>> jax_dfccl.config.timeout_s
    60.0
    >>> jax_dfccl.configure(timeout_s=300.0)
  """
  from jax_dfccl.config import FLAT, Config
  for k in entries:
    if k not in FLAT:
      raise AttributeError(f"jax_dfccl.configure: unknown entry {k!r}; the entries are jax_dfccl.config's "
                           f"(flat names: {', '.join(sorted(FLAT))})")
  old = config.as_dict()
  try:
    values = {k: Config.coerce(k, v) for k, v in entries.items()}
    for k, v in values.items():
      config._set_flat(k, v)
    for rt in load().values():
      rt.configure(config.as_dict())
  except Exception:
    for k, v in old.items():
      config._set_flat(k, v)
    for rt in _runtimes.values():
      rt.configure(old)
    raise


@contextlib.contextmanager
def configured(**entries):
  """Applies ``configure(**entries)`` inside a ``with`` block and restores the previous values after it.

  The values are restored also when the block raises.  Settings read at trace time (the
  ``overlap_*`` entries) apply to what is traced inside the block.

  Args:
    **entries: as :func:`configure`.

  Returns:
    A context manager; ``with configured(...) as cfg`` binds ``cfg`` to ``jax_dfccl.config``.

  Raises:
    AttributeError: an unknown entry (nothing changed).
    ValueError: a value a runtime rejects, as :func:`configure`.

  Example:
    >>> with jax_dfccl.configured(timeout_s=5.0) as cfg:
    ...   print(cfg.timeout_s)
    5.0
    >>> jax_dfccl.config.timeout_s
    300.0
  """
  old = {k: v for k, v in config.as_dict().items() if k in entries}
  configure(**entries)  # an unknown entry raises here, before anything changed
  try:
    yield config
  finally:
    configure(**old)


#: The keys every backend's ``stats()`` has, with their meaning; the table
#: "stats() keys" of docs/architecture.md is this one (tests/test_contract.py).
STATS_KEYS = {
    "started": "collective tasks started on this process's devices (one per rank and instance)",
    "completed": "... of them completed successfully",
    "failed": "... of them completed with an error (timeout, mismatch, abort)",
    "pending": "started and not yet completed or failed (started - completed - failed)",
    "preemptions": "times a task waiting on peers gave up its worker (thread or daemon lane)",
    "resumes": "times a preempted task ran again",
    "communicators": "device groups with a communicator",
    "instances_live": "collective instances (group, key, sequence) in the runtime's tables",
    "trace_records": "events held in the trace ring buffer(s)",
    "errors": "list of the latest error messages the runtime reported (timeouts, mismatches, aborts; "
              "at most 256, newest last)",
}
#: Backend-specific extras, by platform.
STATS_EXTRAS = {
    "cpu": {
        "daemon_threads": "daemon threads (one per device used)",
        "key_counters": "(group, key) sequence counters held",
        "tickets": "handles started whose done has not run yet",
        "tombstones": "failed instances that some rank never started (cleared when it starts the key "
                      "in a later execution, or by reset())",
        "staging_bytes": "bytes of runtime memory holding the inputs and outputs of collectives in flight "
                         "(and of handles whose done never ran: an abandoned execution's, until reset())",
        "staging_pool_bytes": "bytes of released staging kept for reuse (at most 64 MiB; freed by reset())",
        "shm_process": "this process's index in the job (jax_dfccl.initialize(); -1: one process)",
        "shm_processes": "processes of the job sharing the runtime",
        "shm_live_entries": "entries of the shared instance table in use",
        "shm_staged_bytes": "bytes of this process's staging arena in use",
        "shm_arena_bytes": "size of this process's staging arena (config.shm_arena_bytes)",
    },
    "cuda": {
        "daemon_tasks_done": "tasks the daemon kernels finished (the copy-engine path excluded)",
        "inline_done": "tasks their submit kernels finished themselves (config.tuning.submit_inline_us)",
        "identity_done": "... of them matched by identity without a ticket (config.tuning.small_by_identity; counted "
                         "in started and completed too)",
        "tombstones": "starts this process's failed executions left behind (across processes: their program failed "
                      "before them), skipped by its next execution so its peers' instances fail and the next pair "
                      "(counted in started and completed)",
        "steps": "lane steps the daemons ran",
        "aborted": "tasks the daemons dropped after the watchdog aborted them",
        "launches": "daemon kernel launches",
        "relaunches": "launches after the first, per device, summed",
        "bytes_held": "device memory held by the runtime (bytes)",
        "host_bytes_held": "pinned host memory held by the runtime (bytes)",
        "sms_used": "blocks of the latest daemon (max over devices)",
        "sms_default": "daemon blocks without large messages (config.tuning.max_blocks)",
        "sms_large": "daemon blocks while a large message is pending",
        "daemons_running": "daemon kernels running now",
        "devices": "GPUs the runtime set up",
        "slots_in_use": "pool instance slots in use",
        "instances_waiting_for_slot": "instances queued for a pool slot",
        "copy_engine_ops": "instances moved by the copy engines",
        "copy_engine_issue_us": "host time enqueueing them (all ranks), total",
        "copy_engine_gpu_us": "rank 0's GPU time, first copy to done, total",
        "copy_engine_timed": "copy-engine instances timed for copy_engine_gpu_us",
        "host_start_us": "mean host time in the start handlers",
        "host_done_us": "mean host time in the done handlers",
        "host_streamop_us": "mean host time in their stream memory operations",
        "host_gap_us": "mean time between consecutive handler calls of one XLA thread",
        "host_calls": "start and done handler calls (inside a replayed command buffer none are made)",
        "ranges_exported": "allocations holding this process's XLA buffers shared with other processes",
        "ranges_mapped": "other processes' allocations mapped here (the direct path across processes)",
        "overlap_channels": "fused overlap ops' channels, one per (communicator, key) with buffers (their "
                            "instances are counted in started, completed, failed, pending, instances_live)",
    },
}

def stats() -> dict:
  """Returns the runtimes' counters per backend: ``{'cpu': {...}, 'cuda': {...}}``.

  Every backend has the keys of :data:`STATS_KEYS` (counts since the runtime
  was loaded; the CPU runtime's counters restart at :func:`reset`), plus its
  extras listed in :data:`STATS_EXTRAS` under documented names:

  ==================  ==========================================================
  key                 meaning
  ==================  ==========================================================
  started             collective tasks started on this process's devices (one
                      per rank and instance)
  completed           ... of them completed successfully
  failed              ... of them completed with an error (timeout, mismatch,
                      abort)
  pending             started - completed - failed
  preemptions         times a task waiting on peers gave up its worker
  resumes             times a preempted task ran again
  communicators       device groups with a communicator
  instances_live      instances (group, key, sequence) in the runtime's tables
  trace_records       events held in the trace ring buffer(s)
  errors              list of the latest error messages the runtime reported
                      (timeouts, mismatches, aborts; at most 256, newest last)
  ==================  ==========================================================

  On GPUs the fused overlap ops' instances (``all_gather_matmul``,
  ``matmul_reduce_scatter``) are collectives of the same runtime, counted in the
  ``cuda`` backend's ``started``, ``completed``, ``failed``, ``pending`` and
  ``instances_live``, their trace records in ``trace_records``, their failures in
  ``errors``.

  The configuration a runtime holds is its module's ``config()`` (see
  :func:`runtime_config`), not part of ``stats()``.

  Returns:
    A dict per loaded backend (``'cpu'``, and ``'cuda'`` where GPUs are used) of the
    counters above.

  Raises:
    RuntimeError: no runtime extension could be loaded.

  Example:
    >>> mesh = jax.sharding.Mesh(jax.devices(), ("x",))
    >>> f = jax.jit(jax.shard_map(lambda v: jax_dfccl.psum(v, "x"), mesh=mesh,
    ...                           in_specs=P("x"), out_specs=P()))
    >>> before = jax_dfccl.stats()["cpu"]["completed"]
    >>> _ = f(jnp.arange(8.0)).block_until_ready()
    >>> jax_dfccl.stats()["cpu"]["completed"] - before  # one task per rank
    8
  """
  return {p: dict(rt.stats()) for p, rt in load().items()}


def runtime_config() -> dict:
  """The ``jax_dfccl.config`` entries each loaded runtime holds, as it holds
  them (``{'cpu': {...}, 'cuda': {...}}``): equal to ``jax_dfccl.config`` for
  the entries each one reads."""
  return {p: dict(rt.config()) for p, rt in load().items()}


def pending(wait_ms: int = 1000) -> str:
  """Describes the collectives the runtimes hold in flight right now, per backend.

  Every instance with its key and sequence number and which ranks started it (GPU: also
  whether this device's stream reached it, and what the daemon and the copy-engine mover
  are doing; the fused overlap ops' instances, with the ranks each one waits for).  For a program that seems stuck: call it from another thread (or another
  process's view of the same job).

  Args:
    wait_ms: how long the GPU report tries the runtime lock.

  Returns:
    A readable report (a string), ``"no collective in flight"`` when there is none.

  Raises:
    RuntimeError: no runtime extension could be loaded.

  Example:
    >>> print(jax_dfccl.pending())
    no collective in flight
  """
  parts = []
  for p, rt in load().items():
    r = rt.pending(wait_ms)
    if r:
      parts.append(f"[{p}]\n{r}")
  return "\n".join(parts) if parts else "no collective in flight\n"


def trace_records() -> dict:
  """The runtimes' trace records per backend: ``{'cpu': [...], 'cuda': [...]}``, each
  ``(device, key, seq, event, t_ns)``; the ``cuda`` list includes the fused overlap ops'
  (events ``start``, ``run``, ``finish``, ``error`` from host timestamps)."""
  return {p: list(rt.trace_records()) for p, rt in load().items()}


def raise_if_failed():
  """Raises the failure of a collective that already ran, if one was recorded.

  A GPU collective that fails outside XLA's command buffers (a timeout, a
  mismatch, a dead peer) leaves its program's result unwritten and is reported
  by the device's next collective call; call this after ``block_until_ready``
  on a step's results to learn it before using them.  The failure is raised
  once; the programs after it run.  A fused overlap op's failure
  (``all_gather_matmul``/``matmul_reduce_scatter`` on GPU) is raised every time
  until :func:`reset`: its kernels stopped, so that GPU's CUDA context is lost.  (Inside a command buffer the failure traps
  the GPU's context instead; on CPU a failed collective fails its own program,
  and this returns.)

  Returns:
    None, when no failure is recorded.

  Raises:
    RuntimeError: the recorded failure (its message names the key, the sequence number and
      the ranks).

  Example:
    >>> jax_dfccl.raise_if_failed()  # nothing failed
  """
  for rt in load().values():
    rt.raise_if_failed()


def reset():
  """Drops the runtimes' failed and in-flight state, e.g. after a fault.

  The CPU runtime's counters (:func:`stats`) restart too.  Call it when no program that
  uses jax_dfccl collectives is running.

  Returns:
    None.

  Raises:
    RuntimeError: no runtime extension could be loaded.

  Example:
    >>> jax_dfccl.reset()
    >>> jax_dfccl.stats()["cpu"]["pending"]
    0
  """
  for rt in load().values():
    rt.reset()
