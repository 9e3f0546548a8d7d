"""The GPU runtime across processes: two processes on one GPU under CUDA MPS
(tools/mps_testbed.sh), one GPU per process in the mesh; each rank checks every
collective against numpy (tests/gpu/mp_worker.py), programs that differ per
process, re-entry in a loop, a collective one process never starts, a mismatch
across processes, a peer killed mid-collective, the programs after a timeout, a program
abandoned between a start and its done, send/recv between programs that differ per process."""
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


def _run(case, tmp_path, n=2, timeout=240, keep_going=False, args=(), prefix=()):
  out = tmp_path / case
  cmd = [str(ROOT / "tools/mps_testbed.sh"), "-n", str(n), "--timeout", str(timeout), "--out", str(out),
         *(["--keep-going"] if keep_going else []), "--",
         *prefix, sys.executable, str(ROOT / "tests/gpu/mp_worker.py"), "--case", case, *args]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60, cwd=ROOT)
  results = []
  for r in range(n):
    log = (out / f"rank{r}.log").read_text() if (out / f"rank{r}.log").exists() else ""
    lines = [l for l in log.splitlines() if l.startswith("RESULT ")]
    results.append(json.loads(lines[-1][7:]) if lines else {"ok": False, "log": log[-2000:]})
  return p, results


def test_two_processes_parity_order_and_reentry(tmp_path):
  p, results = _run("parity", tmp_path)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], p.stderr[-2000:], results)
  for r in results:
    assert r["started"] >= 24  # the runtime ran them (both ranks are real processes)


# Each process counted as a host (config.testing.processes_per_host=1): groups spanning hosts are
# matched by announcements (docs/design/announce.md, device/task.h "announce"), each rank's region
# reached by CUDA IPC stores here.
HOSTS = ("--config", "processes_per_host=1")


@pytest.mark.parametrize("n", [2, 4])
def test_groups_spanning_hosts_are_exact_in_any_order(tmp_path, n):
  p, results = _run("parity", tmp_path, n=n, args=HOSTS)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], p.stderr[-2000:], results)
  for r in results:
    assert r["started"] >= 24 and "spans hosts" in r["spans_hosts_refusal"], r


def test_groups_spanning_hosts_in_two_levels_are_exact(tmp_path):
  """Two hosts of two processes each (processes_per_host=2) over NVSHMEM, with
  config.tuning.two_level_plans: psum, all_gather and psum_scatter inside each host, then across
  (lowering_plans._two_level_lowering), at 4 KiB and at 1 MiB per rank (pieces across hosts), exact."""
  _nvshmem_or_skip()
  p, results = _run("parity", tmp_path, n=4,
                    args=("--config", "processes_per_host=2,cross_host_transport=nvshmem,two_level_plans=1"))
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], p.stderr[-2000:], results)
  for r in results:
    assert r["psum_stages"] == ["across", "host", "host2"], r


# The same over NVSHMEM (config.cross_host_transport="nvshmem"): the daemon compiled into
# _dfccl_nvshmem, each rank's region in NVSHMEM's symmetric heap, several PEs on this GPU under MPS.
NVSHMEM_HOSTS = ("--config", "processes_per_host=1,cross_host_transport=nvshmem")


def _nvshmem_or_skip():
  from jax_dfccl._src import nvshmem
  ok, why = nvshmem.available()
  if not ok:
    pytest.skip(why)


@pytest.mark.parametrize("n", [2, 4])
def test_groups_spanning_hosts_over_nvshmem_are_exact_in_any_order(tmp_path, n):
  _nvshmem_or_skip()
  p, results = _run("parity", tmp_path, n=n, args=NVSHMEM_HOSTS)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], p.stderr[-2000:], results)
  for r in results:
    assert r["started"] >= 24 and r["engine"] == "nvshmem", r


def test_groups_spanning_hosts_over_nvshmem_name_a_mismatch(tmp_path):
  _nvshmem_or_skip()
  p, results = _run("mismatch", tmp_path, timeout=120, args=NVSHMEM_HOSTS)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], results)


def test_groups_spanning_hosts_over_nvshmem_name_a_rank_that_never_starts(tmp_path):
  _nvshmem_or_skip()
  p, results = _run("timeout", tmp_path, timeout=120, args=NVSHMEM_HOSTS)
  assert results[0]["ok"], (p.stdout[-3000:], results)


# compute-sanitizer on groups spanning hosts, every op and start/done forms in process-specific
# orders: a start form's staging is allocated while a daemon runs, and memcheck reports a running
# kernel's reads of a later allocation (tools/memcheck_late_alloc_probe.cu), so the site replaces
# the running daemon first (runtime/daemon_path.cc).
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="needs compute-sanitizer")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize("transport", ["stores", "nvshmem"])
def test_groups_spanning_hosts_are_clean_under_compute_sanitizer(tmp_path, tool, transport):
  if transport == "nvshmem":
    _nvshmem_or_skip()
  p, results = _run("parity", tmp_path, timeout=300, args=NVSHMEM_HOSTS if transport == "nvshmem" else HOSTS,
                    prefix=("compute-sanitizer", "--tool", tool, "--error-exitcode", "9"))
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], p.stderr[-2000:], results)
  summary = "ERROR SUMMARY: 0 errors" if tool == "memcheck" else "RACECHECK SUMMARY: 0 hazards"
  for r in range(2):
    assert summary in (tmp_path / "parity" / f"rank{r}.log").read_text(), r


# Two hosts of two processes each (config.testing.processes_per_host=2), over NVSHMEM.
NVSHMEM_2X2 = ("--config", "processes_per_host=2,cross_host_transport=nvshmem")


def test_two_hosts_of_two_are_exact_in_any_order_over_nvshmem(tmp_path):
  _nvshmem_or_skip()
  p, results = _run("parity", tmp_path, n=4, args=NVSHMEM_2X2)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], p.stderr[-2000:], results)


def test_data_parallel_training_across_two_hosts_matches_one_process(tmp_path):
  _nvshmem_or_skip()
  p, results = _run("train", tmp_path, n=4, args=NVSHMEM_2X2)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], results)
  assert all(r["max_rel_err"] < 1e-5 for r in results), results


@pytest.mark.parametrize("args", [HOSTS, NVSHMEM_HOSTS], ids=["stores", "nvshmem"])
def test_reset_across_hosts_lets_a_failed_key_run_again(tmp_path, args):
  if "nvshmem" in args[1]:
    _nvshmem_or_skip()
  p, results = _run("reset", tmp_path, timeout=120, args=args)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], results)


def test_groups_spanning_hosts_name_a_rank_that_never_starts(tmp_path):
  p, results = _run("timeout", tmp_path, timeout=120, args=HOSTS)
  assert results[0]["ok"], (p.stdout[-3000:], results)


def test_groups_spanning_hosts_name_a_mismatch(tmp_path):
  p, results = _run("mismatch", tmp_path, timeout=120, args=HOSTS)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], results)


def test_groups_spanning_hosts_name_a_killed_peer(tmp_path):
  p, results = _run("killed", tmp_path, timeout=120, keep_going=True, args=HOSTS)
  assert results[0]["ok"], (p.stdout[-3000:], results)
  assert results[0]["seconds_after_kill"] <= 6.0
  assert results[0]["named_by"] == "liveness", results[0]  # (another host: no pid to look at)


def test_larger_messages_take_the_direct_path_across_processes(tmp_path):
  p, results = _run("direct", tmp_path)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], p.stderr[-2000:], results)
  for r in results:  # each process exported its buffers' allocations and mapped the other's
    assert r["ranges_exported"] >= 1 and r["ranges_mapped"] >= 1, r


def test_a_rank_that_never_starts_is_named(tmp_path):
  p, results = _run("timeout", tmp_path, timeout=120)
  assert results[0]["ok"], (p.stdout[-3000:], results)


def test_a_mismatch_across_processes_names_the_key_and_both_ranks(tmp_path):
  p, results = _run("mismatch", tmp_path, timeout=120)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], results)


@pytest.mark.parametrize("identity", [0, 1])
def test_instances_started_ahead_do_not_starve_a_peer_of_slots(tmp_path, identity):
  """Rank 0 starts A then B, rank 1 starts B and only then A.  Match table, one small-message
  slot: the slot is the reserve, which only an instance both ranks arrived at may take, so B gets
  it, then A.  By identity, A and B in one bucket of two ways: A's message waits in one way, B
  takes the other.  Exact either way."""
  p, results = _run("slots", tmp_path, timeout=120, args=("--identity", str(identity)))
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], results)


def test_a_killed_peer_is_named_within_the_timeout(tmp_path):
  p, results = _run("killed", tmp_path, timeout=120, keep_going=True)
  assert results[0]["ok"], (p.stdout[-3000:], results)  # rank 1 was killed (no result)
  assert results[0]["seconds_after_kill"] <= 6.0
  assert results[0]["named_by"] == "pid", results[0]


def test_the_programs_after_a_fault_are_exact(tmp_path, monkeypatch):
  # Outside command buffers (inside one, a failure traps the context: README, Limitations).
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  p, results = _run("recover", tmp_path, timeout=150)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], results)
  for r in results:  # every fault was named on the ranks it hit, and each was followed by exact programs
    assert {k for k in r["checks"] if "_fresh_" in k} == {f"{f}_fresh_{i}" for f in ("timeout", "late_rank", "mismatch", "callback")
                                                          for i in range(2)}, r


@pytest.mark.parametrize("cmdbuf", [False, True])  # outside XLA's command buffers, or inside (replayed)
@pytest.mark.parametrize("identity", [1, 0])  # small messages matched by identity, or in the match table
def test_a_retry_after_a_failure_before_the_start_pairs_with_the_right_run(tmp_path, monkeypatch, identity, cmdbuf):
  # Rank 0's program fails (a host callback) before a psum rank 1's run started; rank 0 runs again
  # at once with 103, rank 1 runs with 1 then 2 (docs/design/execution_identity.md, "GPUs"): rank 1's
  # run must fail naming the left-behind execution; rank 0's retry skips the failed run's start (a
  # tombstone).  Outside command buffers both next runs return 105 (103 + 2).  Inside them, a warm
  # run (10 + 20) first, so that the failed run and the retry replay the recorded psum without its
  # handler (checked: fewer handler calls than starts on rank 0); there rank 1's failed collective
  # traps its GPU's context (docs/limitations.md), so the retries may fail too — but never return
  # another value (before the device kept the book, both returned 104 without an error).
  if cmdbuf:
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_graph_min_graph_size=1")  # the psum alone forms a command buffer
  else:
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  warm = 1 if cmdbuf else 0
  p, results = _run("retry", tmp_path, timeout=150,
                    args=("--timeout-s", "8", "--config", f"small_by_identity={identity}", "--warm", str(warm)))
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], results)
  r0, r1 = results[0]["runs"], results[1]["runs"]
  assert all(r["values"] == [30.0] and "error" not in r for r in r0[:warm] + r1[:warm]), (r0, r1)
  assert r0[warm]["injected"], r0
  assert r0[warm + 1]["tombstones"] >= 1, r0  # the retry skipped the failed run's start
  assert "error" in r1[warm], r1
  assert "a peer's program failed" in json.dumps([r1[warm]["error"], results[1]["errors"]]), results[1]
  if cmdbuf:
    assert sum(r["host_calls"] for r in r0) < sum(r["started"] for r in r0), r0  # replayed starts
    assert all("error" in r or r["values"] == [105.0] for r in (r0[warm + 1], r1[warm + 1])), (r0, r1)
  else:
    assert "retry" in r1[warm]["error"], r1
    assert r0[warm + 1]["values"] == [105.0] and r1[warm + 1]["values"] == [105.0], (r0, r1)


@pytest.mark.parametrize("identity", [1, 0])
def test_random_failures_never_pair_runs_that_do_not_belong_together(tmp_path, monkeypatch, identity):
  # tests/multiprocess's chaos_retry on the GPU testbed, outside command buffers: 24 runs, each
  # rank's host callback raising before (20%) or after (10%) its psum by a seeded draw.  A run that
  # ends without an error returns the sum of the same run's inputs; the errors are the injected
  # ones, "a peer's program failed", or a timeout in the last runs.
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  p, results = _run("chaos_retry", tmp_path, timeout=200,
                    args=("--timeout-s", "3", "--runs", "24", "--config", f"small_by_identity={identity}"))
  assert all(r.get("wrong") == 0 for r in results), (p.stdout[-3000:], results)
  for r in results:
    for rec in r["runs"]:
      err = rec.get("error", "")
      assert ("values" in rec or "injected failure" in err or "CpuCallback" in err or "a peer's program failed" in err
              or ("timed out" in err and rec["k"] >= 21)), (r["rank"], rec)


@pytest.mark.parametrize("sizes", ["4096", "1048576"])  # the small (LL) path and the direct path
def test_an_abandoned_program_leaves_nothing_touched(tmp_path, sizes):
  # Rank 0's program fails between a start and its done (a host callback), then rank 0 fills fresh
  # buffers with a sentinel and rank 1 starts the instance: no sentinel buffer may change (XLA gave
  # the failed program's memory to them) and rank 1's result is exact (it read rank 0's operand).
  p, results = _run("abandon", tmp_path, timeout=200,
                    args=("--ops", "all_gather,psum", "--sizes", sizes, "--runs", "3", "--timeout-s", "6"))
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], results)
  probe = results[0]["probe"]
  assert len(probe) == 6 and all(rec["injected"] and rec["touched"] == 0 for rec in probe), probe
  assert results[0]["keeps_touched_at_end"] == 0
  assert [rec["exact"] for rec in results[1]["probe"]] == [True] * 6, results[1]["probe"]


def test_send_recv_between_process_programs(tmp_path):
  p, results = _run("sendrecv", tmp_path, timeout=150)
  assert p.returncode == 0 and all(r["ok"] for r in results), (p.stdout[-3000:], results)


@pytest.mark.parametrize("stages,config", [(2, ""), (4, ""), (4, "processes_per_host=2,cross_host_transport=nvshmem")],
                         ids=["2", "4", "4_two_hosts_nvshmem"])
def test_pipeline_example_on_gpus(tmp_path, stages, config):
  if config:
    _nvshmem_or_skip()
  # One launcher under the testbed's MPS daemon; it starts one process per stage.
  cmd = [str(ROOT / "tools/mps_testbed.sh"), "-n", "1", "--timeout", "200", "--out", str(tmp_path), "--tail", "0", "--",
         sys.executable, str(ROOT / "examples/pipeline_mpmd.py"), "--gpu", "--processes", str(stages), "--steps", "20",
         "--json", "--timeout-s", "30", "--deadline-s", "180", *(["--config", config] if config else [])]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=260, cwd=ROOT)
  log = (tmp_path / "rank0.log").read_text()
  line = next((l for l in log.splitlines() if l.startswith("{")), None)
  assert p.returncode == 0 and line, (p.stdout[-2000:], log[-4000:])
  res = json.loads(line)
  assert res["match"] and res["max_rel_err"] < 1e-5, res  # against the same model trained in one process
