"""The runtimes across processes: bootstrap.

GPU: :func:`initialize` gives the CUDA runtime the global ids of this process's
GPUs; a group of devices spanning processes gets its memory (staging, flags,
the match table) exchanged by CUDA IPC when a program using it is lowered
(:func:`prepare_gpu_group`: each process allocates its ranks' memory, puts the
IPC handles into the key-value store and maps the others').  Larger messages of
such groups take the direct path (``config.tuning.direct``): each process listens at a
Unix socket for the allocations holding the other processes' XLA buffers, which
their owners export as file descriptors when a collective first uses them
(``xla_ffi/runtime/ipc.h``); where XLA's memory cannot be exported (another
allocator), every group of the job stays on the staged paths.

GPUs across hosts: a group whose ranks are on more than one machine (or on more
than one of the hosts ``config.testing.processes_per_host`` simulates) is matched
by announcements (``docs/design/announce.md``); where it spans machines, or
``config.cross_host_transport`` says so, :func:`initialize` sets NVSHMEM up in every
process (``jax_dfccl._src.nvshmem``: the NVSHMEM job, a symmetric allocation for the
groups' regions) and the daemon compiled over NVSHMEM replaces the one that reaches
peers by direct stores.

CPU, the processes of one host:

After ``jax.distributed.initialize(...)``, :func:`initialize` makes the CPU
runtime of every process share one control segment (the instance table of
``xla_ffi/cpu/shm.h``) and each process's staging arena, all POSIX
shared-memory segments.  The ``jax.distributed`` key-value store carries only
their names; data never goes through the coordinator.

Segments never outlive the job: each process unlinks the segments it created
as soon as every process has mapped them (a barrier), so ``/dev/shm`` holds
nothing while the job runs, whatever happens to its processes afterwards
(``kill -9`` included).  Segments left by a process killed between creating
and unlinking (their names carry the creator's pid) are removed by the next
:func:`initialize` on the host.
"""
from __future__ import annotations

import atexit
import math
import os
import pathlib
import secrets
import socket
import threading
from collections.abc import Callable, Sequence

import jax

from jax_dfccl._src import backend, liveness
from jax_dfccl.config import config

_lock = threading.Lock()
_state: dict = {}
_NS = "jax_dfccl/shm"


def _client():
  from jax._src import distributed
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("jax_dfccl.initialize: call jax.distributed.initialize(...) first")
  return client


def initialize(timeout_s: float = 120.0) -> None:
  """Lets jax_dfccl collectives span the processes of a ``jax.distributed`` job on one host.

  CPU devices (shared memory), or NVIDIA GPUs (CUDA IPC).  Call it once in every process,
  after ``jax.distributed.initialize`` and before the first collective; a no-op in a single
  process and when already done.

  Args:
    timeout_s: how long to wait for the other processes.

  Returns:
    None.

  Raises:
    NotImplementedError: devices other than CPUs and NVIDIA GPUs.
    RuntimeError: the job's key-value store or the other processes did not answer within
      ``timeout_s``.

  Example:
    >>> # in every process: jax.distributed.initialize(...), then
    >>> jax_dfccl.initialize()  # (one process here: nothing to do)
  """
  with _lock:
    if _state or jax.process_count() == 1:
      return
    devices = jax.devices()
    if all(d.platform == "gpu" or d.platform == "cuda" for d in devices):
      _initialize_gpu(timeout_s)
      return
    if any(d.platform != "cpu" for d in devices):
      raise NotImplementedError("jax_dfccl.initialize: collectives across processes run on CPU devices and "
                                f"NVIDIA GPUs (found {devices[0].platform} devices)")
    rt = backend.load()["cpu"]
    client = _client()
    nprocs, me = jax.process_count(), jax.process_index()
    ms = int(timeout_s * 1000)
    rt.shm_sweep()  # leftovers of a killed job on this host
    if me == 0:
      token = secrets.token_hex(6)
      client.key_value_set(f"{_NS}/token", token)
    else:
      token = client.blocking_key_value_get(f"{_NS}/token", ms)
    pid = os.getpid()
    created = []
    try:
      arena = f"/dfccl.{pid}.{token}.p{me}"
      rt.shm_create(arena, int(config.shm_arena_bytes), False, nprocs, 0)
      created.append(arena)
      if me == 0:
        control = f"/dfccl.{pid}.{token}.ctrl"
        rt.shm_create(control, 0, True, nprocs, int(config.shm_max_instances))
        created.append(control)
        client.key_value_set(f"{_NS}/{token}/control", control)
      client.key_value_set(f"{_NS}/{token}/arena/{me}", arena)
      control = client.blocking_key_value_get(f"{_NS}/{token}/control", ms)
      arenas = [client.blocking_key_value_get(f"{_NS}/{token}/arena/{p}", ms) for p in range(nprocs)]
      rt.shm_attach(control, arenas, me, [(d.id, d.process_index) for d in devices])
      client.wait_at_barrier(f"{_NS}/{token}/mapped", ms)
    finally:
      for name in created:  # mapped by everyone (or failed): the names can go
        rt.shm_unlink(name)
    atexit.register(rt.shm_detach)
    _state.update(token=token, process=me, processes=nprocs)


def _initialize_gpu(timeout_s: float) -> None:
  rt = backend.load()["cuda"]
  client = _client()
  ms = int(timeout_s * 1000)
  if jax.process_index() == 0:
    client.key_value_set(f"{_NS}/gpu_token", secrets.token_hex(6))
  token = client.blocking_key_value_get(f"{_NS}/gpu_token", ms)
  rt.set_device_ids([(int(d.id), int(d.local_hardware_id)) for d in jax.local_devices()])
  # The machine of every process (groups spanning machines are matched by
  # announcements), and the daemon over NVSHMEM where groups spanning hosts need it.
  me = jax.process_index()
  client.key_value_set(f"{_NS}/{token}/machine/{me}", _machine_id())
  machines = [client.blocking_key_value_get(f"{_NS}/{token}/machine/{p}", ms) for p in range(jax.process_count())]
  transport = config.cross_host_transport
  spans_machines = len(set(machines)) > 1
  if transport == "nvshmem" or (transport == "auto" and spans_machines):
    _initialize_nvshmem(rt, timeout_s, spans_machines)
  # The direct path across processes, if every process's XLA memory can be exported
  # (the same in all processes: pool geometry depends on it).
  why = _exportable(rt) if config.tuning.direct else "jax_dfccl.config.tuning.direct is False"
  client.key_value_set(f"{_NS}/{token}/export/{me}", why or "ok")
  verdicts = [client.blocking_key_value_get(f"{_NS}/{token}/export/{p}", ms) for p in range(jax.process_count())]
  direct = all(v == "ok" for v in verdicts)
  staged_because = next((f"process {p}: {v}" for p, v in enumerate(verdicts) if v != "ok"), "")
  if direct:
    rt.start_ipc(f"jax_dfccl.{token}.{me}")
  elif config.tuning.direct:  # asked for, not possible: say why (larger messages across processes are slower staged)
    import warnings
    warnings.warn(f"jax_dfccl.initialize: groups spanning processes take the staged path ({staged_because})",
                  RuntimeWarning, stacklevel=3)
  _state.update(token=token, process=me, processes=jax.process_count(), gpu=True,
                timeout_ms=ms, groups=set(), direct=direct, staged_because=staged_because,
                machines=machines, engine=rt.daemon_engine())
  # Peers of other hosts have no pid to look at: a heartbeat through the store (liveness.py).
  devices_of: dict[int, list[int]] = {}
  for d in jax.devices():
    devices_of.setdefault(int(d.process_index), []).append(int(d.id))
  _state["watch"] = liveness.start(client, token, me, jax.process_count(),
                                   lambda p, why: rt.set_lost_devices(devices_of.get(p, []), why),
                                   float(config.lost_after_s))


def _machine_id() -> str:
  """This machine, as far as its processes can tell: the boot and the host name."""
  try:
    boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
  except OSError:
    boot = ""
  return f"{socket.gethostname()}/{boot}"


def _initialize_nvshmem(rt, timeout_s: float, spans_machines: bool) -> None:
  """NVSHMEM under the daemon (every process at once, before any collective on a GPU):
  the NVSHMEM job, the symmetric allocation of the groups spanning hosts, the daemon
  over NVSHMEM in place of the direct-stores one."""
  from jax_dfccl._src import nvshmem
  ok, why = nvshmem.available()
  if not ok:
    need = ("the job's processes are on more than one machine" if spans_machines else
            "jax_dfccl.config.cross_host_transport is 'nvshmem'")
    raise RuntimeError(f"jax_dfccl.initialize: {need}, and groups spanning hosts need NVSHMEM here: {why}")
  gpus = jax.local_devices()
  if len(gpus) != 1:
    raise RuntimeError(f"jax_dfccl.initialize: groups spanning hosts over NVSHMEM take one GPU per process "
                       f"(NVSHMEM's one PE per process); this process has {len(gpus)}")
  nvshmem.initialize(timeout_s, int(gpus[0].local_hardware_id))
  mod = nvshmem.load()
  mod.heap(int(config.cross_host_region_bytes))  # collective
  rt.set_daemon_engine(mod.daemon_engine())


def _exportable(rt) -> str:
  """'' when XLA's allocations on every local GPU can be shared with other processes, else why not."""
  import numpy as np
  for d in jax.local_devices():
    x = jax.device_put(np.zeros(64, np.float32), d)
    why = rt.can_export(int(d.local_hardware_id), int(x.unsafe_buffer_pointer()))
    if why:
      return f"GPU {d.id}: {why}"
  return ""


def prepare_gpu_rows(ctx, mesh, ids, rows, wait: bool = False, key: str = "", aval=None) -> None:
  """At lowering: the groups (rows of indices into the device ids ``ids``) of a
  CUDA collective, for those that span processes (see :func:`prepare_gpu_group`).
  Lowering never waits for another process: the peers' memory is imported on a
  thread, and a collective's first call waits for it (at most ``timeout_s``).
  A collective ``key`` whose rank's input (``aval``) is larger than a group
  spanning hosts takes is refused here (ValueError)."""
  if (not _state.get("gpu") or not isinstance(mesh, jax.sharding.Mesh)
      or "cuda" not in getattr(ctx.module_context, "platforms", ())):
    return
  in_bytes = math.prod(aval.shape) * aval.dtype.itemsize if aval is not None else 0
  if limit := piece_bytes(ctx, mesh, ids, lambda: rows, in_bytes):  # (a blocking form got here in pieces)
    raise ValueError(f"jax_dfccl: collective {key!r}: its group spans hosts, where a rank's input to a start "
                     f"form (or a ragged_all_to_all) is at most {limit} bytes for now (this one: {in_bytes}; "
                     "the blocking forms of the other ops take any size)")
  for row in rows:
    group = [int(ids[i]) for i in row]
    prepare_gpu_group(group, wait)


def piece_bytes(ctx, mesh, ids, rows: Callable[[], Sequence], in_bytes: int) -> int:
  """At lowering: where a rank's input of ``in_bytes`` is more than one collective over
  ``rows`` carries (a receive slot's section, where a group spans hosts), that limit;
  else 0.  A blocking collective over more runs as several (lowering_plans); a start
  form is refused (prepare_gpu_rows).  The groups (``rows()``) and which of them span
  hosts are asked of large inputs only."""
  if (not in_bytes or not _state.get("gpu") or not isinstance(mesh, jax.sharding.Mesh)
      or "cuda" not in getattr(ctx.module_context, "platforms", ())):
    return 0
  limit = int(backend.load()["cuda"].announce_max_bytes())
  if in_bytes > limit and any(_spans_hosts([int(ids[i]) for i in row]) for row in rows()):
    return limit
  return 0


def prepare_gpu_group(row, wait: bool = False) -> None:
  """Exchanges the memory of a group of global GPU ids spanning processes (once
  per group; every process whose devices are in it must lower a program using it).
  The handles are exported now and the peers' imported on a thread, so no
  lowering waits for another process's (``.lower()`` of one process returns
  while its peers have not lowered yet); the collective's first call waits (at
  most ``timeout_s``) for the import.  ``wait=True`` imports on the caller's
  thread instead (for tools that set a group up outside any lowering)."""
  if not _state.get("gpu"):
    return
  row = [int(g) for g in row]
  key = ",".join(map(str, row))
  with _lock:
    if key in _state["groups"]:
      return
    local = {int(d.id) for d in jax.local_devices()}
    if all(g in local for g in row) or not any(g in local for g in row):
      return  # one process: the runtime sets it up itself; none here: not this process's group
    rt = backend.runtimes()["cuda"]
    client = _client()
    base = f"{_NS}/{_state['token']}/gpu/{key}"
    spans_hosts = _spans_hosts(row)
    hosts = _hosts(row) if spans_hosts else []
    latency = float(config.testing.cross_host_latency_us)
    for r, g in enumerate(row):
      if g in local:
        client.key_value_set_bytes(f"{base}/{r}", rt.comm_export(row, r, spans_hosts, hosts, latency))
    _state["groups"].add(key)
    if not wait:
      threading.Thread(target=_import, args=(rt, client, base, row, True), daemon=True,
                       name=f"jax_dfccl-import-{key}").start()
      return
  _import(rt, client, base, row)


def _spans_hosts(row) -> bool:
  """Whether the devices of ``row`` (global ids) are on more than one host (:func:`_hosts`).
  A group spanning machines needs NVSHMEM under the daemon (CUDA IPC does not reach
  another machine): refused, naming the setting, without it."""
  hosts = _hosts(row)
  if len(set(hosts)) > 1 and len(set(_state.get("machines") or [])) > 1 and _state.get("engine") != "nvshmem":
    raise RuntimeError(
        f"jax_dfccl: the group of GPUs {row} spans machines, and the daemon here reaches its peers by CUDA "
        f"IPC only (jax_dfccl.config.cross_host_transport is {config.cross_host_transport!r}: 'auto' or "
        "'nvshmem' sets NVSHMEM up at jax_dfccl.initialize())")
  return len(set(hosts)) > 1


def _hosts(row) -> list[int]:
  """The host of each device of ``row``: its machine's index where the job spans machines,
  else the host ``config.testing.processes_per_host`` simulates (0 for all without it)."""
  process = {int(d.id): int(d.process_index) for d in jax.devices()}
  machines = _state.get("machines") or []
  if len(set(machines)) > 1:
    index = {m: i for i, m in enumerate(dict.fromkeys(machines))}
    return [index[machines[process[g]]] for g in row]
  per_host = int(config.testing.processes_per_host)
  return [process[g] // per_host if per_host > 0 else 0 for g in row]


def host_blocks(row) -> tuple[int, int] | None:
  """(H, L) when the devices of ``row`` (global ids) are on H > 1 hosts of L > 1 ranks
  each, every host's ranks consecutive in the row (a two-level plan applies); else None."""
  if not _state:
    return None
  hosts = _hosts(row)
  n, l = len(hosts), hosts.count(hosts[0])
  if l < 2 or n % l or n // l < 2:
    return None
  blocks = [hosts[i:i + l] for i in range(0, n, l)]
  if any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
    return None
  return n // l, l


def _import(rt, client, base, row, threaded: bool = False) -> None:
  try:
    blobs = []
    for r in range(len(row)):
      try:
        blobs.append(client.blocking_key_value_get_bytes(f"{base}/{r}", _state["timeout_ms"]))
      except Exception as e:  # noqa: BLE001  (the key-value store's timeout)
        raise RuntimeError(
            f"jax_dfccl: the group of GPUs {row} spans processes; its rank {r} (device {row[r]}) did not "
            "share its memory: every process with a device in the group must lower a program using the "
            f"group (the exchange happens at lowering) ({e})") from None
    rt.comm_import(row, blobs)
  except Exception as e:  # noqa: BLE001  (on the import thread: the collective's first call then names the group)
    if not threaded:
      raise
    import sys
    print(f"jax_dfccl: {e}", file=sys.stderr, flush=True)


def is_initialized() -> bool:
  """Whether :func:`initialize` connected the runtime across processes."""
  return bool(_state)


def check_reach(devices, api: str) -> None:
  """Raises when a collective's devices span processes before :func:`initialize`
  (the ranks of other processes would never be seen: a hang until timeout_s)."""
  if _state or jax.process_count() == 1:
    return
  me = jax.process_index()
  others = sorted({d.process_index for d in devices if d.process_index != me})
  if others:
    raise RuntimeError(f"jax_dfccl.{api}: its devices belong to processes {[me] + others}; call "
                       "jax_dfccl.initialize() after jax.distributed.initialize() (in every process) first")
