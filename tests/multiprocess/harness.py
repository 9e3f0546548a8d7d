"""Launches multi-process jobs on this host (loopback coordinator on a free
port), with a deadline; never leaves a process behind."""
from __future__ import annotations

import atexit
import dataclasses
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAUNCHED: list[subprocess.Popen] = []  # every process any job started (the leak check reads it)
_OUT_DIRS: list[str] = []  # the jobs' scratch folders, removed when the test process exits


@atexit.register
def _remove_out_dirs():
  for d in _OUT_DIRS:
    shutil.rmtree(d, ignore_errors=True)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def shm_segments() -> list[str]:
  return sorted(glob.glob("/dev/shm/dfccl.*"))


def env(**extra) -> dict:
  # The workers import the jax_dfccl this process imported (the installed package, or a
  # development tree with its extension modules), never a source tree without them.
  import jax_dfccl
  pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(jax_dfccl.__file__)))
  e = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=pkg_parent + os.pathsep + os.environ.get("PYTHONPATH", ""))
  # The test process forces 8 host devices through XLA_FLAGS; workers choose their own.
  e["XLA_FLAGS"] = " ".join(f for f in e.get("XLA_FLAGS", "").split()
                            if not f.startswith("--xla_force_host_platform_device_count"))
  e.update({k: str(v) for k, v in extra.items()})
  return e


@dataclasses.dataclass
class Job:
  codes: list
  outputs: list
  results: list  # the RESULT json of each process (None if it printed none)
  out_dir: str
  seconds: float


def run(cmds: list[list[str]], timeout_s: float, out_dir: str, **extra_env) -> Job:
  t0 = time.monotonic()
  procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(**extra_env))
           for c in cmds]
  LAUNCHED.extend(procs)
  outs = [""] * len(procs)
  try:
    deadline = t0 + timeout_s
    for i, p in enumerate(procs):
      try:
        outs[i], _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        outs[i] = "TIMEOUT"
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  results = []
  for o in outs:
    line = next((l for l in o.splitlines() if l.startswith("RESULT ")), None)
    results.append(json.loads(line[len("RESULT "):]) if line else None)
  return Job([p.returncode for p in procs], outs, results, out_dir, time.monotonic() - t0)


def run_workers(scenario: str, processes: int, devices: int, timeout_s: float = 120.0, **extra_env) -> Job:
  out_dir = tempfile.mkdtemp(prefix=f"dfccl_mp_{scenario}_")
  _OUT_DIRS.append(out_dir)
  port = free_port()
  cmds = [[sys.executable, os.path.join(HERE, "worker.py"), scenario, str(i), str(processes), str(port),
           str(devices), out_dir] for i in range(processes)]
  return run(cmds, timeout_s, out_dir, **extra_env)


def describe(job: Job) -> str:
  return "\n".join(f"--- process {i} (rc {c}) ---\n{o[-4000:]}" for i, (c, o) in enumerate(zip(job.codes, job.outputs)))
