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
  assert dc.stats()["cpu"]["timeout_s"] == 123.0
  dc.configure(timeout_s=300.0)
