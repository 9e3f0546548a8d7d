"""Runtime counters, configuration and the Perfetto/Chrome trace export (CPU backend)."""
import json

import jax
import numpy as np
import pytest

import jax_dfccl as dc
from jax_dfccl import testing as T


def test_stats_and_trace_export(mesh8, tmp_path):
  dc.reset()
  dc.configure(trace=True, spin_budget_us=1.0)
  xs = T.chaos_inputs(mesh8, "x")
  jax.block_until_ready(T.chaos_program(mesh8, "x", 5)(*xs))
  s = dc.stats()["cpu"]
  assert s["started"] == s["completed"] == 5 * T.NUM * 8
  assert s["failed"] == 0 and s["instances_live"] == 0 and s["pending"] == 0
  n = dc.export_trace(str(tmp_path / "trace.json"))
  tr = json.load(open(tmp_path / "trace.json"))
  assert n == len(tr["traceEvents"]) > 0
  slices = [e for e in tr["traceEvents"] if e["ph"] == "X"]
  assert {e["tid"] for e in slices} == set(range(8))  # one track per device
  assert {e["name"].split("#")[0] for e in slices} == {f"chaos/{c[0]}" for c in T.collectives("x", 8)}
  preempts = [e for e in tr["traceEvents"] if e["name"].startswith("preempt")]
  # Counters and trace agree (reset() cleared both; the ring is far from full).
  assert len(preempts) == s["preemptions"]
  dc.configure(trace=False, spin_budget_us=20.0)


def test_configure_rejects_unknown_entries():
  with pytest.raises(AttributeError, match="unknown entry 'timeout'"):
    dc.configure(timeout=3)
  dc.configure(timeout_s=123.0)
  assert dc.config.timeout_s == 123.0
  assert dc._src.backend.runtime_config()["cpu"]["timeout_s"] == 123.0
  dc.configure(timeout_s=300.0)


def test_configured_sets_for_a_block_and_restores():
  before = dc.config.timeout_s
  with dc.configured(timeout_s=77.0, overlap_cluster_m=2):
    assert dc.config.timeout_s == 77.0 and dc.config.overlap.cluster_m == 2
    assert dc._src.backend.runtime_config()["cpu"]["timeout_s"] == 77.0  # pushed to the runtime
  assert dc.config.timeout_s == before and dc.config.overlap.cluster_m == 1
  assert dc._src.backend.runtime_config()["cpu"]["timeout_s"] == before
  with pytest.raises(RuntimeError, match="inside"):
    with dc.configured(timeout_s=55.0):
      raise RuntimeError("inside")
  assert dc.config.timeout_s == before
  with pytest.raises(AttributeError, match="unknown entry 'timeout'"):
    with dc.configured(timeout=3):
      pass
  assert dc.config.timeout_s == before


def test_configure_keeps_an_entrys_declared_type():
  """Values are converted to the entry's declared type; an entry declared ``bool | None`` takes None, True and
  False (and keeps them: None is not False)."""
  assert dc.config.overlap.tma_store is None
  with dc.configured(overlap_tma_store=True, timeout_s=9, overlap_tile_n=128.0):
    assert dc.config.overlap.tma_store is True
    assert type(dc.config.timeout_s) is float and type(dc.config.overlap.tile_n) is int
    with dc.configured(overlap_tma_store=None):
      assert dc.config.overlap.tma_store is None
    with dc.configured(overlap_tma_store=False):
      assert dc.config.overlap.tma_store is False
    assert dc.config.overlap.tma_store is True
  assert dc.config.overlap.tma_store is None and dc.config.overlap.tile_n == 0


def test_pending_names_the_stuck_collective_and_its_ranks(mesh8):
  """jax_dfccl.pending(), called from another thread while a program waits for peers that never
  start a collective, names the collective and which ranks did and did not start it."""
  import threading
  import time

  from jax.sharding import NamedSharding, PartitionSpec as P

  def cpu_report():  # the CPU backend's section (a GPU runtime, if loaded, reports its devices too)
    return dc.pending().split("[cuda]")[0]
  dc.reset()
  assert "[cpu]" not in cpu_report()
  dc.configure(timeout_s=5.0)

  def body(v):
    return jax.lax.cond(jax.lax.axis_index("x") < 2, lambda v: dc.psum(v, "x", key="stuck/psum"),
                        lambda v: v, v)
  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh8, P("x")))
  errors = []

  def run():
    try:
      jax.block_until_ready(f(x))
    except Exception as e:  # noqa: BLE001 - the timeout error is expected
      errors.append(str(e))
  t = threading.Thread(target=run)
  t.start()
  def both_started(report):  # ranks 0 and 1 arrive on their own threads, one may be seen first
    return any("stuck/psum" in l and "started by rank(s) [0 (device " in l and ", 1 (device " in l
               for l in report.splitlines())
  report, deadline = "", time.monotonic() + 4.0
  while not both_started(report) and time.monotonic() < deadline:
    time.sleep(0.05)
    report = cpu_report()
  t.join()
  try:
    jax.effects_barrier()
  except Exception:  # noqa: BLE001 - the failed program's error on the other devices
    pass
  dc.reset()
  dc.configure(timeout_s=300.0)
  line = next(l for l in report.splitlines() if "stuck/psum" in l)
  assert report.startswith("[cpu]") and "seq 0" in line, report
  assert "started by rank(s) [0 (device " in line and ", 1 (device " in line, line
  assert "not by [2 (device " in line and ", 7 (device " in line, line
  assert errors and "stuck/psum" in errors[0]
  assert "[cpu]" not in cpu_report()


def test_trace_export_of_gpu_stream_events():
  """GPU records (synthetic here): each submit kernel and each done wait become slices
  on the device's XLA stream track; the daemon's run..finish a slice on its own."""
  from jax_dfccl.trace import to_chrome_trace
  us = 1000  # ns per µs
  recs = [("cuda", 0, "k", 3, ev, t * us) for ev, t in
          [("submit_enter", 0), ("submit_matched", 4), ("submit_published", 10), ("start", 11),
           ("run", 12), ("stream_wait", 13), ("finish", 20), ("stream_woke", 21)]]
  ev = {e["name"]: e for e in to_chrome_trace(recs)["traceEvents"] if e["ph"] == "X"}
  assert set(ev) == {"submit k#3", "wait k#3", "k#3"}
  assert (ev["submit k#3"]["ts"], ev["submit k#3"]["dur"], ev["submit k#3"]["tid"]) == (0, 10, "0 XLA stream")
  assert (ev["wait k#3"]["ts"], ev["wait k#3"]["dur"]) == (13, 8)
  assert (ev["k#3"]["ts"], ev["k#3"]["dur"], ev["k#3"]["tid"]) == (12, 8, 0)


def test_trace_export_of_the_inline_kernels_steps():
  """An inline submit kernel's lane (inline_lane..lane_fenced) is a slice inside its submit slice on
  the XLA stream track, its single steps instants there; no done wait (it completed the task)."""
  from jax_dfccl.trace import to_chrome_trace
  us = 1000
  recs = [("cuda", 1, "k", 0, ev, t * us) for ev, t in
          [("submit_enter", 0), ("submit_matched", 4), ("inline_lane", 5), ("lane_polled", 6),
           ("lane_combined", 7), ("lane_fenced", 8), ("submit_published", 9), ("inline_completed", 11)]]
  evs = to_chrome_trace(recs)["traceEvents"]
  sl = {e["name"]: e for e in evs if e["ph"] == "X"}
  assert set(sl) == {"submit k#0", "lane k#0"}
  assert (sl["lane k#0"]["ts"], sl["lane k#0"]["dur"], sl["lane k#0"]["tid"]) == (5, 3, "1 XLA stream")
  assert (sl["submit k#0"]["ts"], sl["submit k#0"]["dur"]) == (0, 9)
  inst = sorted((e["ts"], e["name"]) for e in evs if e["ph"] == "i" and e["tid"] == "1 XLA stream")
  assert inst == [(6, "lane_polled k#0"), (7, "lane_combined k#0"), (11, "inline_completed k#0")]


def test_trace_event_names_are_the_device_enum():
  """The runtime's event names (task.h kTraceEventNames) follow the TraceEvent enum, one by one."""
  import pathlib
  import re
  text = (pathlib.Path(__file__).resolve().parents[1] / "xla_ffi" / "device" / "task.h").read_text()
  enum = re.search(r"enum TraceEvent : uint16_t \{(.*?)\};", text, re.S).group(1)
  ids = {n: int(v) for n, v in re.findall(r"kEv(\w+) = (\d+)", enum)}
  names = re.findall(r'"(\w+)"', re.search(r"kTraceEventNames\[kNumTraceEvents\] = \{(.*?)\};", text, re.S).group(1))
  n_events = int(re.search(r"kNumTraceEvents = (\d+)", enum).group(1))
  assert len(names) == n_events == len(ids)
  snake = lambda s: re.sub(r"(?<!^)(?=[A-Z])", "_", s).lower()  # noqa: E731
  assert [snake(n) for n, _ in sorted(ids.items(), key=lambda kv: kv[1])] == names
