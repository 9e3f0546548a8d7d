"""CPU tests: the fused overlap ops as collectives of the ``cuda`` backend, on the Python side.

The fused ops live in ``_dfccl_cuda`` (when built with CUTLASS: ``has_overlap``) and their instances
are the GPU runtime's own collectives (xla_ffi/runtime/overlap_path.h): its ``stats()`` (exact keys:
``backend.STATS_KEYS`` + ``STATS_EXTRAS``, ``overlap_channels`` among them), ``pending()``,
``trace_records()``, ``raise_if_failed()`` and ``reset()`` include them, and ``backend.py`` passes
them through unchanged.  ``overlap_gpu.module()`` is that module on sm90 GPUs, else None.  The
kernels need sm90 GPUs (tests/gpu/test_overlap_gpu.py); here a stand-in for ``_dfccl_cuda`` is put
where ``backend.load()`` returns it.
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
  """A ``cuda`` runtime's stats(): every documented key."""
  s = {k: 0 for k in backend.STATS_KEYS}
  s.update({k: 0 for k in backend.STATS_EXTRAS["cuda"]})
  s["errors"] = []
  s.update(kw)
  return s


class FakeRuntime:
  """Stands in for ``_dfccl_cuda`` (the CPU runtime is the real one)."""

  def __init__(self, stats=None, pending="GPU 0: daemon running\n", records=(), has_overlap=True):
    self._stats = stats or _cuda_stats()
    self._pending = pending
    self._records = list(records)
    self.has_overlap = has_overlap
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


@pytest.fixture
def with_cuda(monkeypatch):
  """backend.load() with the real CPU runtime and a stand-in ``cuda`` one (sm90 GPUs: the fused ops'
  module is that one)."""
  cpu = backend.load()["cpu"]
  cuda = FakeRuntime()
  monkeypatch.setattr(backend, "load", lambda: {"cpu": cpu, "cuda": cuda})
  monkeypatch.setattr(og, "_gpu", lambda: True)
  monkeypatch.setattr(og, "_mod", [])
  return cuda


# --- the module ---------------------------------------------------------------------------------


def test_module_is_the_cuda_runtime(with_cuda):
  assert og.loaded() is None  # not looked for yet
  assert og.module() is with_cuda and og.loaded() is with_cuda and og.available()


def test_module_without_the_fused_ops(with_cuda):
  """``_dfccl_cuda`` built without CUTLASS: no fused ops, the XLA-dot schedule."""
  with_cuda.has_overlap = False
  assert og.module() is None and not og.available()
  og.check()  # nothing to raise


def test_module_not_loaded_on_cpu():
  assert og.module() is None and og.loaded() is None and not og.available()
  og.check()  # nothing to raise


def test_the_cuda_module_says_whether_it_has_them():
  import importlib
  try:
    m = importlib.import_module("jax_dfccl._dfccl_cuda")
  except ImportError:
    pytest.skip("the CUDA backend is not built")
  assert isinstance(m.has_overlap, bool)
  assert hasattr(m, "plan") == m.has_overlap and hasattr(m, "_profile_results") == m.has_overlap


# --- stats, pending, trace: the runtime's own ---------------------------------------------------


def test_stats_are_the_runtime_s_own(with_cuda):
  with_cuda._stats = _cuda_stats(started=4, completed=3, pending=1, overlap_channels=1)
  s = jax_dfccl.stats()
  assert s["cuda"] == with_cuda._stats
  assert set(s["cuda"]) == set(backend.STATS_KEYS) | set(backend.STATS_EXTRAS["cuda"])
  assert "overlap_channels" not in s["cpu"]


_LINE = (f"GPU 0: fused all_gather_matmul dfccl: collective '{KEY}' (sequence 1, group of GPUs [0,1]) rank 0, "
         "812.4 ms, started S., this stream reached it 811.9 ms ago (fails at timeout_s 2 s), "
         "waiting for rank(s) [1 (GPU 1)]: never started it\n")


def test_pending_lists_fused_instances_under_cuda(with_cuda):
  with_cuda._pending = "GPU 0: daemon running\n" + _LINE
  text = jax_dfccl.pending()
  cuda_part = text[text.index("[cuda]\n"):]
  assert cuda_part == "[cuda]\nGPU 0: daemon running\n" + _LINE
  assert "waiting for rank(s) [1 (GPU 1)]" in cuda_part


def test_trace_records_include_fused_ops_and_export_as_slices(with_cuda, tmp_path):
  ov_recs = [(0, KEY, 1, "start", 100), (0, KEY, 1, "run", 110), (0, KEY, 1, "finish", 300),
             (1, KEY, 1, "start", 105), (1, KEY, 1, "run", 120), (1, KEY, 1, "error", 2_000_000_120)]
  with_cuda._records = sorted([(0, "psum/k", 0, "start", 50), (0, "psum/k", 0, "run", 60),
                               (0, "psum/k", 0, "finish", 90)] + ov_recs, key=lambda r: r[4])
  recs = trace.records()
  cuda = [r[1:] for r in recs if r[0] == "cuda"]
  assert sorted(cuda, key=lambda r: r[4]) == cuda  # time-sorted
  assert set(cuda) == set(with_cuda._records)
  tr = trace.to_chrome_trace([r for r in recs if r[0] == "cuda"])
  slices = {(e["tid"], e["name"]): e for e in tr["traceEvents"] if e["ph"] == "X"}
  assert slices[(0, f"{KEY}#1")]["args"]["ended_by"] == "finish"
  assert slices[(0, f"{KEY}#1")]["dur"] == pytest.approx((300 - 110) / 1e3)
  assert slices[(1, f"{KEY}#1")]["args"]["ended_by"] == "error"
  assert any(e["name"] == f"error {KEY}#1" for e in tr["traceEvents"])
  assert jax_dfccl.export_trace(str(tmp_path / "t.json")) == len(trace.to_chrome_trace(recs)["traceEvents"])


# --- failures, reset, configuration -------------------------------------------------------------

_MSG = (f"dfccl: collective '{KEY}' (sequence 1, group of GPUs [0,1]) timed out after 2 s: "
        "rank(s) [1 (GPU 1)] never started it")


def test_raise_if_failed_reaches_the_fused_ops(with_cuda):
  assert og.module() is with_cuda
  jax_dfccl.raise_if_failed()  # nothing failed
  with_cuda.raised = _MSG
  with pytest.raises(RuntimeError, match=r"collective 'ag:256x256@256x512:bfloat16' \(sequence 1, .*rank\(s\) "
                                         r"\[1 \(GPU 1\)\] never started it"):
    jax_dfccl.raise_if_failed()
  with pytest.raises(RuntimeError, match="never started it"):
    og.check()  # the same failure through the overlap module's own helper


def test_reset_reaches_the_runtime_once(with_cuda):
  og.module()
  jax_dfccl.reset()
  assert with_cuda.resets == 1


def test_configure_reaches_the_runtime_once(with_cuda):
  og.module()
  old = config.timeout_s
  n = len(with_cuda.configured)
  with jax_dfccl.configured(timeout_s=7.5):
    assert with_cuda.configured[-1]["timeout_s"] == 7.5 and len(with_cuda.configured) == n + 1
  assert with_cuda.configured[-1]["timeout_s"] == old


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
