"""``python -m jax_dfccl.demo`` on CPU: two processes of a jax.distributed job, three rows.

The demo's table is checked against what its processes reported (the JSON line it prints), not
only against its own verdicts: jax.lax with a stuck rank was still waiting (or failed) without
naming the rank; jax_dfccl failed within timeout_s naming the key, the rank and its process, and
pending() showed the instance in both processes while process 0 waited; the MPMD programs'
values were exact on both processes.
"""
import json
import subprocess
import sys

from conftest import child_env

from jax_dfccl import demo


def _run_demo():
  p = subprocess.run([sys.executable, "-P", "-m", "jax_dfccl.demo", "--json"], env=child_env(1),
                     capture_output=True, text=True, timeout=150)
  line = next((l for l in p.stdout.splitlines() if l.startswith("JSON ")), None)
  assert line is not None, p.stdout[-3000:] + p.stderr[-3000:]
  return p, {(r["scenario"], r["collectives"]): r for r in json.loads(line[len("JSON "):])}


def test_demo_rows_show_what_they_claim():
  p, rows = _run_demo()
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert set(rows) == {("stuck rank", "jax.lax (gloo)"), ("stuck rank", "jax_dfccl"),
                       ("MPMD send/recv", "jax_dfccl")}, rows.keys()
  assert all(r["shown"] and len(r["proves"]) == 2 for r in rows.values()), rows

  lax = rows[("stuck rank", "jax.lax (gloo)")]["evidence"]
  if lax["outcome"] is None:  # still in the collective when the demo killed it
    assert lax["killed"] and "still waiting" in rows[("stuck rank", "jax.lax (gloo)")]["result"], lax
  else:  # or it failed: then its error must not name the stuck process
    assert lax["outcome"]["outcome"] == "error" and "process 1" not in lax["outcome"]["error"], lax

  ours = rows[("stuck rank", "jax_dfccl")]["evidence"]
  err, key, timeout_s = ours["error"], ours["key"], ours["timeout_s"]
  assert f"'{key}'" in err and "timed out" in err, err
  assert "1 (device" in err and "process 1" in err and "never started" in err, err
  assert timeout_s - 0.2 < ours["seconds"] < timeout_s + 2.0, ours
  for report in ours["pending"]:  # from both processes, while process 0 waited
    assert f"'{key}' seq 1" in report and "not by [1 (device" in report and "process 1" in report, report

  mpmd = rows[("MPMD send/recv", "jax_dfccl")]["evidence"]["processes"]
  assert [m["checked"] for m in mpmd] == [["c"], ["a", "b"]] and all(m["exact"] for m in mpmd), mpmd
  # The table itself: each row's two lines under it.
  for r in rows.values():
    for line in r["proves"]:
      assert line in p.stdout


def test_demo_exits_1_when_a_row_does_not_show_its_claim(monkeypatch):
  good = demo.Row("s", "lib", "r", True, ("a", "b"))
  bad = demo.Row("s", "lib", "WRONG", False, ("a", "b"))
  monkeypatch.setattr(demo, "_gpu_count", lambda: 0)
  monkeypatch.setattr(demo, "_lax_stuck_row", lambda: good)
  monkeypatch.setattr(demo, "_dfccl_rows", lambda: [good, bad])
  assert demo.main([]) == 1
  monkeypatch.setattr(demo, "_dfccl_rows", lambda: [good, good])
  assert demo.main([]) == 0


def test_demo_chaos_rows_run(monkeypatch, mesh8):
  """The GPU rows' code on 8 CPU devices (its jax.lax child looks for GPUs and fails): jax_dfccl's
  rank-specific order is exact; the jax.lax row, which claims a hang, does not count as shown."""
  monkeypatch.setattr(demo, "_gpu_mesh", lambda: mesh8)
  lax, ours = demo._chaos_rows()
  assert ours.lib == "jax_dfccl" and ours.result == "exact" and ours.shown, ours.as_dict()
  assert lax.lib == "jax.lax (NCCL)" and not lax.shown and lax.result.startswith("error"), lax.as_dict()
