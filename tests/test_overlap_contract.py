"""CPU tests: the fused overlap ops as collectives of the ``cuda`` backend, on the Python side.

What ``jax_dfccl/_src/backend.py`` does with the ``_dfccl_overlap`` module once it is loaded: its
stats added to the ``cuda`` backend's (exact keys: ``backend.STATS_KEYS`` + ``STATS_EXTRAS``), its
pending lines under ``[cuda]``, its trace records in ``jax_dfccl.trace``, its failures raised by
``raise_if_failed()``, ``reset()`` and the configuration reaching it -- and, with the module absent,
everything as before.  The module itself needs sm90 GPUs (tests/gpu/test_overlap_gpu.py); here a
stand-in with its functions is put where ``overlap_gpu.module()`` keeps it.
"""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_dfccl  # noqa: E402
from jax_dfccl import trace  # noqa: E402
from jax_dfccl._src import backend, overlap_gpu as og  # noqa: E402
from jax_dfccl.config import Config, config  # noqa: E402

KEY = "ag:256x256@256x512:bfloat16"


def _cuda_stats(**kw):
  """A ``cuda`` runtime's stats(): every documented key but the overlap extra."""
  s = {k: 0 for k in backend.STATS_KEYS}
  s.update({k: 0 for k in backend.STATS_EXTRAS["cuda"] if k not in backend.STATS_ADDED["cuda"]})
  s["errors"] = []
  s.update(kw)
  return s


class FakeRuntime:
  """Stands in for ``_dfccl_cuda`` (the CPU runtime is the real one)."""

  def __init__(self, stats=None, pending="GPU 0: daemon running\n", records=()):
    self._stats = stats or _cuda_stats()
    self._pending = pending
    self._records = list(records)
    self.configured, self.resets, self.raised = [], 0, None

  def stats(self):
    return dict(self._stats)

  def pending(self, wait_ms):
    return self._pending

  def trace_records(self):
    return list(self._records)

  def configure(self, cfg):
    self.configured.append(dict(cfg))

  def raise_if_failed(self):
    if self.raised:
      raise RuntimeError(self.raised)

  def reset(self):
    self.resets += 1


class FakeOverlap(FakeRuntime):
  """Stands in for ``_dfccl_overlap``: the functions backend.py reads."""

  def __init__(self, reject_timeout=None, **kw):
    super().__init__(**kw)
    self.reject_timeout = reject_timeout

  def configure(self, cfg):
    if self.reject_timeout is not None and cfg.get("timeout_s") == self.reject_timeout:
      raise ValueError(f"dfccl overlap: timeout_s must be > 0 seconds, got {cfg['timeout_s']}")
    super().configure(cfg)


@pytest.fixture
def with_cuda(monkeypatch):
  """backend.load() with the real CPU runtime and a stand-in ``cuda`` one; no overlap module."""
  cpu = backend.load()["cpu"]
  cuda = FakeRuntime()
  monkeypatch.setattr(backend, "load", lambda: {"cpu": cpu, "cuda": cuda})
  monkeypatch.setattr(og, "_mod", [])
  return cuda


def _use_overlap(monkeypatch, ov):
  monkeypatch.setattr(og, "_mod", [ov])
  return ov


# --- stats -------------------------------------------------------------------------------------


def test_merge_without_the_module_only_adds_the_extra():
  cuda = _cuda_stats(started=5, completed=4, failed=1, errors=["e"])
  got = backend.merge_overlap_stats(cuda, None)
  assert got == {**cuda, "overlap_channels": 0}
  assert set(got) == set(backend.STATS_KEYS) | set(backend.STATS_EXTRAS["cuda"])


def test_merge_adds_the_fused_instances_to_the_cuda_counts():
  cuda = _cuda_stats(started=10, completed=7, failed=1, pending=2, instances_live=3, trace_records=100,
                     communicators=2, errors=["runtime error"])
  ov = {"started": 6, "completed": 3, "failed": 1, "pending": 2, "instances_live": 2, "trace_records": 12,
        "channels": 2, "errors": ["fused error"]}
  got = backend.merge_overlap_stats(cuda, ov)
  assert (got["started"], got["completed"], got["failed"]) == (16, 10, 2)
  assert got["pending"] == got["started"] - got["completed"] - got["failed"] == 4
  assert got["instances_live"] == 5 and got["trace_records"] == 112
  assert got["communicators"] == 2  # the runtime's own: a channel is no communicator
  assert got["overlap_channels"] == 2
  assert got["errors"] == ["runtime error", "fused error"]
  assert set(got) == set(backend.STATS_KEYS) | set(backend.STATS_EXTRAS["cuda"])


def test_merge_keeps_the_newest_256_errors():
  cuda = _cuda_stats(errors=[f"r{i}" for i in range(200)])
  ov = {k: 0 for k in ("started", "completed", "failed", "pending", "instances_live", "trace_records",
                       "channels")}
  ov["errors"] = [f"o{i}" for i in range(100)]
  got = backend.merge_overlap_stats(cuda, ov)["errors"]
  assert len(got) == 256 and got[-1] == "o99" and got[0] == "r44"


def test_stats_merges_the_loaded_module(with_cuda, monkeypatch):
  with_cuda._stats = _cuda_stats(started=2, completed=2)
  assert jax_dfccl.stats()["cuda"] == {**with_cuda._stats, "overlap_channels": 0}
  ov = _use_overlap(monkeypatch, FakeOverlap(stats={"started": 2, "completed": 1, "failed": 0, "pending": 1,
                                                     "instances_live": 1, "trace_records": 0, "channels": 1,
                                                     "errors": []}))
  s = jax_dfccl.stats()
  assert s["cuda"]["started"] == 4 and s["cuda"]["completed"] == 3 and s["cuda"]["pending"] == 1
  assert s["cuda"]["overlap_channels"] == 1
  assert s["cpu"] == backend.load()["cpu"].stats() | {"errors": s["cpu"]["errors"]}  # the CPU entry untouched
  assert "overlap_channels" not in s["cpu"]
  assert ov.stats()["channels"] == 1


def test_stats_without_a_gpu_is_unchanged(monkeypatch):
  """On CPU (no ``cuda`` runtime) a loaded overlap module is never consulted."""
  monkeypatch.setattr(og, "_mod", [FakeOverlap(stats={"started": 99})])  # would break a merge
  s = jax_dfccl.stats()
  assert set(s) == {"cpu"}
  assert set(s["cpu"]) == set(backend.STATS_KEYS) | set(backend.STATS_EXTRAS["cpu"])


def test_module_not_loaded_on_cpu():
  assert og.module() is None and og.loaded() is None and not og.available()
  og.check()  # nothing to raise


# --- pending -----------------------------------------------------------------------------------

_LINE = (f"GPU 0: fused all_gather_matmul dfccl: collective '{KEY}' (sequence 1, group of GPUs [0,1]) rank 0, "
         "812.4 ms, started S., this stream reached it 811.9 ms ago (fails at timeout_s 2 s), "
         "waiting for rank(s) [1 (GPU 1)]: never started it\n")


def test_pending_lists_fused_instances_under_cuda(with_cuda, monkeypatch):
  _use_overlap(monkeypatch, FakeOverlap(pending=_LINE))
  text = jax_dfccl.pending()
  cuda_part = text[text.index("[cuda]\n"):]
  assert cuda_part == "[cuda]\nGPU 0: daemon running\n" + _LINE
  assert "waiting for rank(s) [1 (GPU 1)]" in cuda_part


def test_pending_unchanged_without_the_module(with_cuda):
  text = jax_dfccl.pending()
  assert text.endswith("[cuda]\nGPU 0: daemon running\n")


def test_pending_idle_module_adds_nothing(with_cuda, monkeypatch):
  _use_overlap(monkeypatch, FakeOverlap(pending=""))
  assert jax_dfccl.pending().endswith("[cuda]\nGPU 0: daemon running\n")


def test_pending_fused_only(monkeypatch):
  """A cuda runtime with nothing to say and a stuck fused op: the op's line under [cuda]."""
  cpu = backend.load()["cpu"]
  monkeypatch.setattr(backend, "load", lambda: {"cpu": cpu, "cuda": FakeRuntime(pending="")})
  monkeypatch.setattr(og, "_mod", [FakeOverlap(pending=_LINE)])
  assert jax_dfccl.pending().endswith("[cuda]\n" + _LINE)


# --- trace -------------------------------------------------------------------------------------


def test_trace_records_include_fused_ops_and_export_as_slices(with_cuda, monkeypatch, tmp_path):
  with_cuda._records = [(0, "psum/k", 0, "start", 50), (0, "psum/k", 0, "run", 60), (0, "psum/k", 0, "finish", 90)]
  ov_recs = [(0, KEY, 1, "start", 100), (0, KEY, 1, "run", 110), (0, KEY, 1, "finish", 300),
             (1, KEY, 1, "start", 105), (1, KEY, 1, "run", 120), (1, KEY, 1, "error", 2_000_000_120)]
  _use_overlap(monkeypatch, FakeOverlap(records=ov_recs))
  recs = trace.records()
  cuda = [r[1:] for r in recs if r[0] == "cuda"]
  assert sorted(cuda, key=lambda r: r[4]) == cuda  # time-sorted
  assert set(cuda) == set(with_cuda._records) | set(ov_recs)
  tr = trace.to_chrome_trace([r for r in recs if r[0] == "cuda"])
  slices = {(e["tid"], e["name"]): e for e in tr["traceEvents"] if e["ph"] == "X"}
  assert slices[(0, f"{KEY}#1")]["args"]["ended_by"] == "finish"
  assert slices[(0, f"{KEY}#1")]["dur"] == pytest.approx((300 - 110) / 1e3)
  assert slices[(1, f"{KEY}#1")]["args"]["ended_by"] == "error"
  assert any(e["name"] == f"error {KEY}#1" for e in tr["traceEvents"])
  assert jax_dfccl.export_trace(str(tmp_path / "t.json")) == len(trace.to_chrome_trace(recs)["traceEvents"])


def test_trace_records_unchanged_without_the_module(with_cuda):
  with_cuda._records = [(0, "k", 0, "start", 1)]
  assert backend.trace_records()["cuda"] == [(0, "k", 0, "start", 1)]


# --- failures, reset, configuration -------------------------------------------------------------

_MSG = (f"dfccl: collective '{KEY}' (sequence 1, group of GPUs [0,1]) timed out after 2 s: "
        "rank(s) [1 (GPU 1)] never started it")


def test_raise_if_failed_reaches_the_fused_ops(with_cuda, monkeypatch):
  jax_dfccl.raise_if_failed()  # the module absent: nothing
  ov = _use_overlap(monkeypatch, FakeOverlap())
  jax_dfccl.raise_if_failed()
  ov.raised = _MSG
  with pytest.raises(RuntimeError, match=r"collective 'ag:256x256@256x512:bfloat16' \(sequence 1, .*rank\(s\) "
                                         r"\[1 \(GPU 1\)\] never started it"):
    jax_dfccl.raise_if_failed()
  with pytest.raises(RuntimeError, match="never started it"):
    og.check()  # the same failure through the overlap module's own helper


def test_reset_reaches_the_fused_ops(with_cuda, monkeypatch):
  ov = _use_overlap(monkeypatch, FakeOverlap())
  jax_dfccl.reset()
  assert ov.resets == 1 and with_cuda.resets == 1


def test_configure_pushes_to_the_fused_ops(with_cuda, monkeypatch):
  ov = _use_overlap(monkeypatch, FakeOverlap())
  old = config.timeout_s
  with jax_dfccl.configured(timeout_s=7.5):
    assert ov.configured[-1]["timeout_s"] == 7.5 and with_cuda.configured[-1]["timeout_s"] == 7.5
  assert ov.configured[-1]["timeout_s"] == old


def test_configure_rejected_by_the_fused_ops_changes_nothing(with_cuda, monkeypatch):
  ov = _use_overlap(monkeypatch, FakeOverlap(reject_timeout=9.0))
  before = config.as_dict()
  cpu_before = dict(backend.load()["cpu"].config())
  with pytest.raises(ValueError, match="timeout_s"):
    jax_dfccl.configure(timeout_s=9.0)
  assert config.as_dict() == before
  assert dict(backend.load()["cpu"].config()) == cpu_before  # rolled back after the CPU runtime took it
  assert ov.configured[-1]["timeout_s"] == before["timeout_s"]


def test_the_one_timeout():
  """The fused ops have no timeout of their own: config.timeout_s bounds them."""
  assert not hasattr(Config().overlap, "wait_timeout_s")
  with pytest.raises(AttributeError):
    jax_dfccl.configure(overlap_wait_timeout_s=1.0)


# --- the custom call: key, no timeout attribute ---------------------------------------------------


@pytest.mark.parametrize("kind", ["ag", "rs"])
def test_lowering_names_the_key_and_leaves_the_timeout_to_the_runtime(monkeypatch, kind):
  from jax_dfccl._src import overlap as ov
  monkeypatch.setattr(og, "available", lambda: True)
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  if kind == "ag":
    op, specs, out = ov.all_gather_matmul, (P("tp", None), P(None, "tp")), P(None, "tp")
    shapes, key = ((2 * 200, 136), (136, 2 * 136)), "ag:200x136@136x136:bfloat16"
  else:
    op, specs, out = ov.matmul_reduce_scatter, (P(None, "tp"), P("tp", None)), P("tp", None)
    shapes, key = ((2 * 200, 2 * 72), (2 * 72, 136)), "rs:400x72@72x136:bfloat16"
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, sp)) for s, sp in zip(shapes, specs)]
  f = jax.jit(jax.shard_map(lambda x, w: op(x, w, "tp"), mesh=mesh, in_specs=specs, out_specs=out))
  text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert f"dfccl_overlap_{kind}" in text
  assert f'key = "{key}"' in text
  assert "timeout_ns" not in text


def test_key_names_kind_shapes_and_dtype():
  a = jax.core.ShapedArray((256, 128), jnp.float16)
  b = jax.core.ShapedArray((128, 64), jnp.float16)
  assert og._key("rs", a, b) == "rs:256x128@128x64:float16"
  assert og._key("ag", a, b) != og._key("ag", a.update(dtype=jnp.bfloat16), b.update(dtype=jnp.bfloat16))
