"""tools/mps_testbed.sh on the CPU machine: a stand-in nvidia-cuda-mps-control (a detached
process that writes its pid file and a "server" child, and quits on `echo quit |`) checks that
the launcher always quits the daemon (success, a failed rank, the timeout, SIGTERM; a daemon that
ignores quit is killed by its pid), kills the other ranks when one fails, returns the failed
rank's status, and gives each rank its environment."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTBED = str(ROOT / "tools" / "mps_testbed.sh")

# Stand-in for nvidia-cuda-mps-control: `-d` starts a detached daemon (pid file in the pipe
# folder, as the real one writes, plus a "server" child); `echo CMD |` talks to it.  With
# MOCK_MPS_STUBBORN=1 the daemon and its server ignore quit and SIGTERM.
MOCK = r"""#!/usr/bin/env bash
d=$CUDA_MPS_PIPE_DIRECTORY; l=$CUDA_MPS_LOG_DIRECTORY
if [[ ${1:-} == -d ]]; then
  setsid bash -c '
    d=$1; l=$2
    [[ ${MOCK_MPS_STUBBORN:-0} == 1 ]] && trap "" TERM
    bash -c "trap \"\" TERM; while :; do sleep 0.05; done" & srv=$!
    echo $$ > "$d/nvidia-cuda-mps-control.pid"; echo $srv > "$d/server"
    echo "started $$ server $srv" >> "$l/control.log"; echo "$$ $srv" >> "$MOCK_MPS_PIDS"
    mkfifo "$d/control"
    while :; do
      if [[ -e $d/quit && ${MOCK_MPS_STUBBORN:-0} != 1 ]]; then
        kill -KILL $srv; echo "quit $$" >> "$l/control.log"; rm -f "$d/control"; exit 0
      fi
      sleep 0.05
    done' mockd "$d" "$l" < /dev/null > /dev/null 2>&1 &
  exit 0
fi
[[ -e $d/control ]] || { echo "cannot find MPS control daemon" >&2; exit 1; }
while read -r cmd; do
  case $cmd in
    quit) touch "$d/quit" ;;
    get_server_list) cat "$d/server" ;;
  esac
done
"""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:  # a zombie waiting for its parent to reap it is dead too
    return " Z " not in pathlib.Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
  except OSError:
    return False


@pytest.fixture
def mock_path(tmp_path, monkeypatch):
  bindir = tmp_path / "bin"
  bindir.mkdir()
  exe = bindir / "nvidia-cuda-mps-control"
  exe.write_text(MOCK)
  exe.chmod(0o755)
  pids = tmp_path / "mock_pids"
  monkeypatch.setenv("MOCK_MPS_PIDS", str(pids))
  yield str(bindir) + os.pathsep + os.environ["PATH"]
  for pid in (pids.read_text().split() if pids.exists() else []):  # whatever the launcher left
    try:
      os.kill(int(pid), signal.SIGKILL)
    except ProcessLookupError:
      pass


def _run(args, path, out, env_extra=None, timeout=60):
  env = dict(os.environ, PATH=path, PYTHON=sys.executable, **(env_extra or {}))
  return subprocess.run(["bash", TESTBED, "--out", str(out), *args], env=env, capture_output=True,
                        text=True, timeout=timeout)


def _daemon_pids(out):
  log = (out / "mps_control.log").read_text()
  m = re.search(r"started (\d+) server (\d+)", log)
  assert m, log
  return int(m.group(1)), int(m.group(2)), log


def _assert_daemon_gone(out, quit_expected=True):
  daemon, server, log = _daemon_pids(out)
  deadline = time.time() + 5
  while (_alive(daemon) or _alive(server)) and time.time() < deadline:
    time.sleep(0.05)
  assert not _alive(daemon) and not _alive(server)
  assert (f"quit {daemon}" in log) == quit_expected, log


def test_success_env_and_quit(tmp_path, mock_path):
  code = ("import os; print('ENV', *(os.environ[k] for k in ('DFCCL_TESTBED_RANK', 'DFCCL_TESTBED_NPROC', "
          "'DFCCL_TESTBED_COORD', 'DFCCL_TESTBED_MPS', 'DFCCL_TESTBED_TMP', 'CUDA_MPS_PIPE_DIRECTORY')))")
  r = _run(["-n", "3", "--", sys.executable, "-c", code], mock_path, tmp_path / "o")
  assert r.returncode == 0, r.stdout + r.stderr
  rows = [(tmp_path / "o" / f"rank{i}.log").read_text().split() for i in range(3)]
  assert [row[1:3] for row in rows] == [[str(i), "3"] for i in range(3)]
  assert len({row[3] for row in rows}) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+", rows[0][3])
  assert all(row[4] == "1" for row in rows)
  assert not os.path.exists(rows[0][5]) and not os.path.exists(rows[0][6])  # scratch and pipe removed
  assert "[rank 2] ENV 2 3" in r.stdout
  _assert_daemon_gone(tmp_path / "o")


def test_failed_rank_kills_the_others(tmp_path, mock_path):
  pidfile = tmp_path / "sleeper.pid"
  code = ("import os, sys, time\n"
          "if os.environ['DFCCL_TESTBED_RANK'] == '1': time.sleep(0.3); sys.exit(3)\n"
          f"open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
  t = time.time()
  r = _run(["-n", "2", "--", sys.executable, "-c", code], mock_path, tmp_path / "o")
  assert r.returncode == 3, r.stdout + r.stderr
  assert time.time() - t < 20
  assert "rank 1 failed" in r.stdout
  assert not _alive(int(pidfile.read_text()))
  _assert_daemon_gone(tmp_path / "o")


def test_keep_going_lets_the_others_finish(tmp_path, mock_path):
  code = ("import os, sys, time\n"
          "if os.environ['DFCCL_TESTBED_RANK'] == '1': sys.exit(3)\n"
          "time.sleep(1.5); print('FINISHED')")
  r = _run(["-n", "2", "--keep-going", "--", sys.executable, "-c", code], mock_path, tmp_path / "o")
  assert r.returncode == 3, r.stdout + r.stderr  # the first failed rank's status
  assert "FINISHED" in (tmp_path / "o" / "rank0.log").read_text()
  assert "killing the others" not in r.stdout
  _assert_daemon_gone(tmp_path / "o")


def test_timeout(tmp_path, mock_path):
  r = _run(["-n", "2", "--timeout", "1", "--", "sleep", "120"], mock_path, tmp_path / "o")
  assert r.returncode == 124, r.stdout + r.stderr
  assert "timeout after 1s" in r.stdout
  _assert_daemon_gone(tmp_path / "o")


def test_sigterm_quits_daemon(tmp_path, mock_path):
  out = tmp_path / "o"
  env = dict(os.environ, PATH=mock_path, PYTHON=sys.executable)
  p = subprocess.Popen(["bash", TESTBED, "--out", str(out), "-n", "2", "--", "sleep", "120"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 20
  while not (out / "rank1.log").exists() and time.time() < deadline:
    time.sleep(0.05)
  time.sleep(0.3)
  p.send_signal(signal.SIGTERM)
  stdout, _ = p.communicate(timeout=30)
  assert p.returncode == 143, stdout
  _assert_daemon_gone(out)


def test_stubborn_daemon_is_killed(tmp_path, mock_path):
  r = _run(["-n", "1", "--", "true"], mock_path, tmp_path / "o", {"MOCK_MPS_STUBBORN": "1", "DFCCL_TESTBED_QUIT_S": "1"})
  assert r.returncode == 0, r.stdout + r.stderr
  assert "still alive after quit: killed" in r.stdout
  _assert_daemon_gone(tmp_path / "o", quit_expected=False)


def test_no_mps_and_missing_daemon(tmp_path):
  code = "import os; print('MPS', os.environ['DFCCL_TESTBED_MPS'])"
  r = _run(["--no-mps", "-n", "2", "--", sys.executable, "-c", code], os.environ["PATH"], tmp_path / "o")
  assert r.returncode == 0, r.stdout + r.stderr
  assert (tmp_path / "o" / "rank1.log").read_text().strip() == "MPS 0"
  if shutil.which("nvidia-cuda-mps-control") is None:
    r = _run(["-n", "2", "--", "true"], os.environ["PATH"], tmp_path / "p")
    assert r.returncode == 2 and "nvidia-cuda-mps-control not found" in r.stderr and "--no-mps" in r.stderr


def test_usage_errors(tmp_path):
  for args in (["-n", "0", "--", "true"], ["-n", "2"], ["--bogus", "--", "true"]):
    r = _run(["--no-mps", *args], os.environ["PATH"], tmp_path / "o")
    assert r.returncode == 2 and "mps_testbed:" in r.stderr, (args, r.stderr)


PINGPONG = str(ROOT / "benchmarks" / "pingpong_mps.py")


@pytest.mark.parametrize("exchange", ["file", "kv"])
def test_pingpong_dry_run(tmp_path, exchange):
  """benchmarks/pingpong_mps.py's host protocol (handle exchange, barriers, the JSON) without a GPU."""
  out = tmp_path / "pp.json"
  r = _run(["--no-mps", "-n", "2", "--timeout", "120", "--", sys.executable, PINGPONG, "--dry-run",
            "--exchange", exchange, "--json", str(out)], os.environ["PATH"], tmp_path / "o", timeout=180)
  assert r.returncode == 0, r.stdout + r.stderr
  import json
  doc = json.loads(out.read_text())
  assert doc["mps"] is False and doc["exchange"] == exchange and doc["launcher"] == "tools/mps_testbed.sh"
  assert doc["rank0"] == {"rank": 0, "dry_run": True} and doc["rank1"] == {"rank": 1, "dry_run": True}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_pingpong_kernels_compile(tmp_path):
  import importlib.util
  spec = importlib.util.spec_from_file_location("pingpong_mps", PINGPONG)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  (tmp_path / "k.cu").write_text(mod.KERNELS)
  r = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr


IPC_EXPORT = str(ROOT / "benchmarks" / "ipc_export_mps.py")


def test_ipc_export_dry_run(tmp_path):
  """benchmarks/ipc_export_mps.py's host protocol (key-value exchange, barrier, the JSON) without a GPU."""
  out = tmp_path / "ipc.json"
  r = _run(["--no-mps", "-n", "2", "--timeout", "120", "--", sys.executable, IPC_EXPORT, "--dry-run",
            "--json", str(out)], os.environ["PATH"], tmp_path / "o", timeout=180)
  assert r.returncode == 0, r.stdout + r.stderr
  import json
  doc = json.loads(out.read_text())
  assert doc["benchmark"] == "ipc_export_mps" and doc["mps"] is False and doc["preallocate"] == "false"
  assert doc["rank0"] == {"rank": 0, "dry_run": True} and doc["rank1"] == {"rank": 1, "dry_run": True}
