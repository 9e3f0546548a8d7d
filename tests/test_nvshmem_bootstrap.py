"""NVSHMEM's set-up through the job's key-value store (jax_dfccl/_src/nvshmem.py), with
the NVSHMEM module and the store replaced by fakes: process 0 publishes the unique id
under a key per set-up, every process joins with that id as the PE of its process
index, and an absent module says why.  (On GPUs: tests/gpu/test_nvshmem_transport.py.)"""
from __future__ import annotations

import threading

import pytest

from jax_dfccl._src import nvshmem


class Store:
  """The jax.distributed client's key-value calls over one dict shared by the 'processes'."""

  def __init__(self):
    self.kv, self.cv = {}, threading.Condition()

  def key_value_set_bytes(self, k, v):
    with self.cv:
      assert k not in self.kv, f"key {k} set twice"
      self.kv[k] = bytes(v)
      self.cv.notify_all()

  def blocking_key_value_get_bytes(self, k, ms):
    with self.cv:
      if not self.cv.wait_for(lambda: k in self.kv, ms / 1000):
        raise RuntimeError(f"key {k} not set within {ms} ms")
      return self.kv[k]


class Module:
  def __init__(self, uid):
    self.uid, self.joined = uid, []

  def unique_id(self):
    return self.uid

  def initialized(self):
    return False

  def init(self, uid, rank, n, device=-1):
    self.joined.append((uid, rank, n))
    return "FULL_MPG"


def test_process_zero_publishes_the_id_and_every_process_joins_with_it():
  store, n = Store(), 4
  mods = [Module(uid=bytes([r + 1]) * 128) for r in range(n)]  # only process 0's id may be used
  results, threads = {}, []
  for rank in reversed(range(1, n)):  # the others ask before process 0 has published: they wait
    t = threading.Thread(target=lambda r=rank: results.__setitem__(
        r, nvshmem._join(mods[r], store, r, n, "jax_dfccl/nvshmem/uid/1", 5000)))
    t.start()
    threads.append(t)
  threads[0].join(0.2)
  assert all(t.is_alive() for t in threads) and not results, "a process joined before process 0 published the id"
  results[0] = nvshmem._join(mods[0], store, 0, n, "jax_dfccl/nvshmem/uid/1", 5000)
  for t in threads:
    t.join(5)
  assert results == {r: "FULL_MPG" for r in range(n)}
  assert [m.joined for m in mods] == [[(bytes([1]) * 128, r, n)] for r in range(n)]


def _one_process(monkeypatch, store, mod):
  monkeypatch.setattr(nvshmem, "load", lambda: mod)
  monkeypatch.setattr("jax_dfccl._src.distributed._client", lambda: store)


def test_each_set_up_has_its_own_key(monkeypatch):
  store = Store()
  mod = Module(uid=b"a" * 128)
  _one_process(monkeypatch, store, mod)
  before = nvshmem._state["inits"]
  nvshmem.initialize(timeout_s=5)
  mod.uid = b"b" * 128
  nvshmem.initialize(timeout_s=5)
  assert [u for u, _, _ in mod.joined] == [b"a" * 128, b"b" * 128]
  assert set(store.kv) == {f"jax_dfccl/nvshmem/uid/{before + 1}", f"jax_dfccl/nvshmem/uid/{before + 2}"}


def test_a_missing_id_is_an_error_not_a_hang(monkeypatch):
  store = Store()
  mod = Module(uid=b"x" * 128)
  _one_process(monkeypatch, store, mod)
  monkeypatch.setattr(nvshmem.jax, "process_index", lambda: 1)
  monkeypatch.setattr(nvshmem.jax, "process_count", lambda: 2)
  with pytest.raises(RuntimeError, match="not set within"):
    nvshmem.initialize(timeout_s=0.2)
  assert mod.joined == []


def test_without_the_module_it_says_why(monkeypatch):
  monkeypatch.setattr(nvshmem, "_state", {"module": None, "why": "", "inits": 0, "status": ""})
  monkeypatch.setattr(nvshmem.importlib, "import_module", lambda name: (_ for _ in ()).throw(ImportError(name)))
  monkeypatch.setattr(nvshmem.importlib.util, "find_spec", lambda name: None)
  ok, why = nvshmem.available()
  assert not ok and "built without NVSHMEM" in why and "nvidia-nvshmem-cu13" in why
  with pytest.raises(ImportError, match="built without NVSHMEM"):
    nvshmem.load()


def test_the_real_module_refuses_collective_calls_before_set_up():
  """Where the module is built (CI builds it wherever nvcc is), the transport check and NVSHMEM's
  own collectives called before initialize() raise naming the missing set-up, with no GPU needed."""
  ok, why = nvshmem.available()
  if not ok:
    pytest.skip(why)
  mod = nvshmem.load()
  assert not mod.initialized()
  with pytest.raises(ValueError, match="Native before Init"):
    nvshmem.native_collective("psum", [4096])
  with pytest.raises(ValueError, match="Check before Init"):
    nvshmem.check_transport()
