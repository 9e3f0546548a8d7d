"""jax_dfccl.initialize() on GPUs, without a GPU: the processes agree on the direct path across
processes (``distributed._initialize_gpu``). Each process probes whether its XLA memory can be
exported (one buffer per local device, through the runtime's ``can_export``), puts its verdict into
the key-value store and reads every other process's; the listener starts only when every verdict is
"ok", so all processes make the same choice. The runtime and the key-value store are stand-ins that
record what they are asked; the buffers are real (this process's CPU devices)."""
from __future__ import annotations

import jax
import pytest

from jax_dfccl._src import distributed

NS = distributed._NS


class Store:
  """The key-value store: what was set, and the other processes' entries given up front."""

  def __init__(self, entries):
    self.kv = dict(entries)

  def key_value_set(self, key, value):
    self.kv[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    if key not in self.kv:
      raise TimeoutError(key)
    return self.kv[key]


class Runtime:
  """The CUDA runtime's bootstrap functions; can_export answers `why` for every buffer."""

  def __init__(self, why=""):
    self.why, self.started, self.ids, self.probed = why, [], None, []

  def set_device_ids(self, ids):
    self.ids = ids

  def can_export(self, ordinal, ptr):
    self.probed.append((ordinal, ptr))
    return self.why

  def start_ipc(self, name):
    self.started.append(name)

  def daemon_engine(self):
    return "stores"


@pytest.fixture
def bootstrap(monkeypatch):
  """Runs _initialize_gpu as process `me` of `nprocs`, the others' verdicts given."""
  def run(why="", others=("ok",), me=1, direct=True, machines=None):
    nprocs = len(others) + 1
    rt = Runtime(why)
    entries = {f"{NS}/gpu_token": "tok"}
    for p, v in zip([p for p in range(nprocs) if p != me], others):
      entries[f"{NS}/tok/export/{p}"] = v
      entries[f"{NS}/tok/machine/{p}"] = machines[p] if machines else distributed._machine_id()
    store = Store(entries)
    monkeypatch.setattr(distributed.backend, "load", lambda: {"cuda": rt})
    monkeypatch.setattr(distributed, "_client", lambda: store)
    monkeypatch.setattr(distributed, "_state", {})
    monkeypatch.setattr(jax, "process_index", lambda: me)
    monkeypatch.setattr(jax, "process_count", lambda: nprocs)
    saved = distributed.config.tuning.direct
    distributed.config._set_flat("direct", direct)  # Python's value only: the runtime here is a fake
    try:
      distributed._initialize_gpu(1.0)
    finally:
      distributed.config._set_flat("direct", saved)
    return rt, store, distributed._state
  return run


def test_every_process_can_export_so_the_listener_starts(bootstrap):
  rt, store, state = bootstrap()
  assert store.kv[f"{NS}/tok/export/1"] == "ok"
  assert rt.started == ["jax_dfccl.tok.1"] and state["direct"] and state["staged_because"] == ""
  devices = jax.local_devices()
  assert [o for o, _ in rt.probed] == [int(d.local_hardware_id) for d in devices]
  assert all(ptr != 0 for _, ptr in rt.probed)  # a real buffer of each device
  assert rt.ids == [(int(d.id), int(d.local_hardware_id)) for d in devices]


def test_a_process_that_cannot_export_keeps_everyone_staged(bootstrap):
  # This process can; process 2 cannot: no listener here, and the reason (also warned) names process 2.
  with pytest.warns(RuntimeWarning, match="staged path.*process 2: GPU 2"):
    rt, store, state = bootstrap(others=("ok", "GPU 2: cuMemRetainAllocationHandle failed"), me=1)
  assert store.kv[f"{NS}/tok/export/1"] == "ok"
  assert rt.started == [] and not state["direct"]
  assert state["staged_because"].startswith("process 2: GPU 2:")


def test_this_process_cannot_export(bootstrap):
  with pytest.warns(RuntimeWarning, match="not a cuMemCreate allocation"):
    rt, store, state = bootstrap(why="not a cuMemCreate allocation")
  verdict = store.kv[f"{NS}/tok/export/1"]
  assert verdict.startswith("GPU ") and verdict.endswith("not a cuMemCreate allocation")
  assert rt.started == [] and state["staged_because"] == f"process 1: {verdict}"


def test_direct_off_skips_the_probe(bootstrap, recwarn):
  rt, store, state = bootstrap(direct=False)
  assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]  # nothing asked for, nothing to say
  assert rt.probed == [] and rt.started == []
  assert store.kv[f"{NS}/tok/export/1"] == "jax_dfccl.config.tuning.direct is False"
  assert state["staged_because"] == "process 1: jax_dfccl.config.tuning.direct is False"


def test_a_peer_that_never_gives_its_verdict_is_named(monkeypatch):
  # Process 0 never wrote its verdict: the wait for it fails naming its key (the store's timeout).
  rt, store = Runtime(), Store({f"{NS}/gpu_token": "tok", f"{NS}/tok/machine/0": distributed._machine_id()})
  monkeypatch.setattr(distributed.backend, "load", lambda: {"cuda": rt})
  monkeypatch.setattr(distributed, "_client", lambda: store)
  monkeypatch.setattr(distributed, "_state", {})
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(TimeoutError, match="export/0"):
    distributed._initialize_gpu(1.0)
  assert rt.started == []


def test_lowering_never_waits_for_another_process(monkeypatch):
  """A group spanning processes gets its memory exchanged when a program using it is lowered:
  this process's handles go into the key-value store at once, the peers' are imported on a
  thread, so `.lower()` returns while the peer has not lowered yet (the previous build blocked
  in the store until it did); the import completes once the peer's handles arrive."""
  import threading
  import time

  class SlowStore:
    def __init__(self):
      self.kv, self.cv = {}, threading.Condition()

    def key_value_set_bytes(self, key, value):
      with self.cv:
        self.kv[key] = value
        self.cv.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_ms):
      with self.cv:
        if not self.cv.wait_for(lambda: key in self.kv, timeout_ms / 1000):
          raise TimeoutError(key)
        return self.kv[key]

  class Cuda:
    def __init__(self):
      self.imported = threading.Event()

    def comm_export(self, row, r, spans_hosts=False, hosts=(), latency_us=0.0):
      return f"blob{r}".encode()

    def comm_import(self, row, blobs):
      self.blobs = blobs
      self.imported.set()

  store, rt = SlowStore(), Cuda()
  local = jax.local_devices()[0]
  monkeypatch.setattr(distributed, "_client", lambda: store)
  monkeypatch.setattr(distributed.backend, "runtimes", lambda: {"cuda": rt})
  monkeypatch.setattr(distributed, "_state", {"gpu": True, "token": "t", "groups": set(), "timeout_ms": 10_000})
  row = [int(local.id), 10_000 + int(local.id)]  # a device of this process and one of another
  t0 = time.monotonic()
  distributed.prepare_gpu_group(row)  # as the lowering calls it
  assert time.monotonic() - t0 < 1.0 and not rt.imported.is_set()
  assert store.kv == {f"{NS}/t/gpu/{row[0]},{row[1]}/0": b"blob0"}
  store.key_value_set_bytes(f"{NS}/t/gpu/{row[0]},{row[1]}/1", b"blob1")  # the peer lowers later
  assert rt.imported.wait(5.0) and rt.blobs == [b"blob0", b"blob1"]


def test_processes_on_one_machine_set_up_no_nvshmem(bootstrap):
  # config.cross_host_transport "auto": every process on this machine, so no NVSHMEM job is made and
  # the daemon keeps its direct stores; the machines are kept for the groups' set-up.
  rt, store, state = bootstrap()
  assert store.kv[f"{NS}/tok/machine/1"] == distributed._machine_id()
  assert state["machines"] == [distributed._machine_id()] * 2 and state["engine"] == "stores"


def test_processes_on_two_machines_need_nvshmem(bootstrap, monkeypatch):
  # "auto" with process 0 on another machine: NVSHMEM is set up at initialize(); where it cannot be
  # had, initialize() says why, naming what asked for it.
  from jax_dfccl._src import nvshmem
  monkeypatch.setattr(nvshmem, "available", lambda: (False, "jax_dfccl: built without NVSHMEM"))
  saved = distributed.config.cross_host_transport
  distributed.config._set_flat("cross_host_transport", "auto")
  try:
    with pytest.raises(RuntimeError, match="more than one machine.*built without NVSHMEM"):
      bootstrap(machines={0: "elsewhere/boot"})
  finally:
    distributed.config._set_flat("cross_host_transport", saved)


def test_a_group_spanning_machines_without_nvshmem_is_refused(bootstrap, monkeypatch):
  # "stores": no NVSHMEM, so a group whose ranks are on two machines is refused when a program using
  # it is lowered, naming the setting; a group within one machine is not affected.
  saved = distributed.config.cross_host_transport
  distributed.config._set_flat("cross_host_transport", "stores")
  try:
    rt, store, state = bootstrap(machines={0: "elsewhere/boot"})
  finally:
    distributed.config._set_flat("cross_host_transport", saved)
  monkeypatch.setattr(distributed, "_state", state)
  fake = [type("D", (), {"id": i, "process_index": i % 2})() for i in range(4)]
  monkeypatch.setattr(jax, "devices", lambda: fake)
  with pytest.raises(RuntimeError, match=r"spans machines.*CUDA IPC only.*cross_host_transport"):
    distributed._spans_hosts([0, 1])
  assert not distributed._spans_hosts([1, 3])  # both on process 1's machine


def test_the_host_of_each_rank_is_its_machine_or_its_simulated_host(monkeypatch):
  # What a group spanning hosts is told of each rank (the transport's remote ranks, whose puts the
  # simulated latency delays): the machine's index where the job spans machines, else the host
  # config.testing.processes_per_host makes of consecutive processes.
  fake = [type("D", (), {"id": i, "process_index": i})() for i in range(4)]
  monkeypatch.setattr(jax, "devices", lambda: fake)
  monkeypatch.setattr(distributed, "_state", {"machines": ["b/1", "a/1", "a/1", "b/1"], "engine": "nvshmem"})
  assert distributed._hosts([0, 1, 2, 3]) == [0, 1, 1, 0] and distributed._hosts([2, 0]) == [1, 0]
  monkeypatch.setattr(distributed, "_state", {"machines": ["m/1"] * 4, "engine": "nvshmem"})
  saved = distributed.config.testing.processes_per_host
  distributed.config._set_flat("processes_per_host", 2)
  try:
    assert distributed._spans_hosts([1, 2]) and not distributed._spans_hosts([2, 3])
    assert distributed._hosts([0, 1, 2, 3]) == [0, 0, 1, 1] and distributed._hosts([3, 1]) == [1, 0]
  finally:
    distributed.config._set_flat("processes_per_host", saved)
