"""Protocol C (xla_ffi/transport/announce.cuh) over NVSHMEM between processes: two and
four processes on one GPU under CUDA MPS (NVSHMEM runs several PEs on one GPU there),
NVSHMEM set up through the jax.distributed key-value store (jax_dfccl/_src/nvshmem.py).
Each process checks on the device every instance's sum against the reference, the
mismatches named alike on every rank, the cap refused at once — over NVSHMEM and over
direct stores to the peers' symmetric memory (tests/gpu/nvshmem_worker.py)."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from jax_dfccl.testing import gpus

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(gpus()) < 1, reason="needs a GPU"),
              pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="needs CUDA MPS")]


def _available():
  from jax_dfccl._src import nvshmem
  return nvshmem.available()


# (processes, processes per simulated host, µs each put to another host waits first)
@pytest.mark.parametrize("n,per_host,delay_us", [(2, 0, 0), (4, 0, 0), (2, 1, 5), (4, 2, 5)])
def test_protocol_c_over_nvshmem_between_processes(tmp_path, n, per_host, delay_us):
  ok, why = _available()
  if not ok:
    pytest.skip(why)
  out = tmp_path / f"nv{n}"
  cmd = [str(ROOT / "tools/mps_testbed.sh"), "-n", str(n), "--timeout", "150", "--out", str(out), "--",
         sys.executable, str(ROOT / "tests/gpu/nvshmem_worker.py"), "--blocks", "40", "--pingpong", "500",
         "--ranks-per-host", str(per_host), "--delay-us", str(delay_us)]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=210, cwd=ROOT)
  results = []
  for r in range(n):
    log = (out / f"rank{r}.log").read_text() if (out / f"rank{r}.log").exists() else ""
    lines = [l for l in log.splitlines() if l.startswith("RESULT ")]
    results.append(json.loads(lines[-1][7:]) if lines else {"ok": False, "log": log[-3000:]})
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-2000:], p.stderr[-2000:], results)
  for r in results:
    nv = next(x for x in r["runs"] if x["transport"] == "nvshmem")
    assert nv["ok"] == r["expected"]["ok"] and nv["failed_as_expected"] == r["expected"]["failed_as_expected"]
  if per_host == 1:  # processes 0 and 1 on two simulated hosts: each leg of a round trip waits delay_us
    for run in results[0]["runs"]:
      if not run["skipped"]:
        assert run["round_trip_us"]["median"] >= 2 * delay_us, run
