"""The soak on GPUs (tests/gpu/soak_worker.py): random collectives in
process-specific orders against numpy, memory flat — on one GPU (a group of one
forced through the runtime) and on two processes sharing the GPU under MPS."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from jax_dfccl.testing import gpus

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests/gpu/soak_worker.py"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(len(gpus()) < 1, reason="needs a GPU")]


def _result(text):
  lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
  assert lines, text[-3000:]
  return json.loads(lines[-1][7:])


def _show(results):
  return json.dumps(results)[:3000]


def test_soak_one_gpu():
  p = subprocess.run([sys.executable, str(WORKER), "--instances", "2000"], capture_output=True, text=True,
                     timeout=400, cwd=ROOT)
  r = _result(p.stdout + p.stderr)
  assert p.returncode == 0 and r["ok"], (_show(r), p.stderr[-3000:])
  assert r["runtime_started"] >= r["instances"] >= 2000  # every instance went through the runtime


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="needs CUDA MPS")
@pytest.mark.parametrize("config", ["", "small_slots=2"])
def test_soak_two_processes(tmp_path, config):
  # small_slots=2: every key's small messages share one bucket of two staging cells per peer
  # (device/task.h, "identity"), so instances wait for each other's cells all the time.
  cmd = [str(ROOT / "tools/mps_testbed.sh"), "-n", "2", "--timeout", "400", "--out", str(tmp_path), "--tail", "0",
         "--", sys.executable, str(WORKER), "--instances", "2000", "--watch", "60",
         *(["--config", config] if config else [])]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=460, cwd=ROOT)
  logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
  stalled = [l[l.index("STALLED"):][:3000] for l in logs if "STALLED" in l]  # the watcher's pending() report
  assert not stalled, stalled
  results = [_result(l) for l in logs]
  assert p.returncode == 0 and all(r["ok"] for r in results), _show(results)
  assert all(r["ranks"] == 2 and r["runtime_started"] >= r["instances"] for r in results), results
