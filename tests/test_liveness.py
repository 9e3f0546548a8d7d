"""The liveness watch across hosts (jax_dfccl/_src/liveness.py) over a real key-value
store (jaxlib's coordination service, three clients in this process as the processes of
a job): a process that goes silent is reported lost after ``lost_after_s``, one that
says ``exit`` at once, one whose heartbeat keeps going never.  (The store gone, which
loses process 0, is not run here: a jaxlib client that sees its service gone ends its
process.)  (The runtime's side, a rank's pending collectives failing naming it:
tests/gpu/test_gpu_multiprocess.py, the killed case between simulated hosts.)"""
from __future__ import annotations

import socket
import threading
import time

import pytest

from jax_dfccl._src import liveness


def _job(n):
  from jax._src.lib import _jax
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  addr = f"127.0.0.1:{port}"
  service = _jax.get_distributed_runtime_service(addr, n, heartbeat_timeout=60)
  clients = [_jax.get_distributed_runtime_client(addr, i, init_timeout=20, heartbeat_timeout=60,
                                                 shutdown_on_destruction=False) for i in range(n)]
  threads = [threading.Thread(target=c.connect) for c in clients]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  return service, clients


class Reports:
  def __init__(self):
    self.got, self.lock = [], threading.Lock()

  def __call__(self, me):
    def report(p, why):
      with self.lock:
        self.got.append((me, p, why, time.monotonic()))
    return report

  def of(self, me):
    with self.lock:
      return [(p, why, t) for m, p, why, t in self.got if m == me]


@pytest.fixture
def job():
  service, clients = _job(3)
  yield clients
  threads = [threading.Thread(target=c.shutdown) for c in clients]  # (clients first: a client that
  for t in threads:                                                  # sees its service gone ends the process)
    t.start()
  for t in threads:
    t.join(30)
  service.shutdown()


def _watches(clients, reports, lost_after_s, token="t"):
  return [liveness.Watch(c, token, i, len(clients), reports(i), lost_after_s) for i, c in enumerate(clients)]


def test_silent_process_is_lost_after_the_window_and_an_exiting_one_at_once(job):
  reports = Reports()
  ws = _watches(job, reports, 0.8)
  for w in ws:
    w.start()
  time.sleep(1.2)  # everyone heartbeats: nobody lost
  assert reports.got == []
  t_kill = time.monotonic()
  ws[2].stop(exiting=False)  # killed: no word, the heartbeat just stops
  deadline = time.monotonic() + 5
  while time.monotonic() < deadline and not (reports.of(0) and reports.of(1)):
    time.sleep(0.02)
  for me in (0, 1):
    (p, why, t), = reports.of(me)
    assert p == 2 and "has not written its heartbeat for 0.8 s" in why and "process 2 is lost" in why
    # (counted from the last heartbeat seen: up to a period, 0.1 s, before the stop)
    assert 0.8 - 0.1 - 0.05 <= t - t_kill <= 0.8 + 0.5, t - t_kill
  t_exit = time.monotonic()
  ws[1].stop(exiting=True)  # a clean exit says so
  while time.monotonic() < t_exit + 3 and len(reports.of(0)) < 2:
    time.sleep(0.02)
  assert [(p, why) for p, why, _ in reports.of(0)][1] == (1, "process 1 is lost: its process exited")
  assert reports.of(0)[1][2] - t_exit < 0.4
  ws[0].stop()
  for w in ws:
    w.join(2)


def test_alive_processes_are_never_lost_and_tokens_do_not_mix(job):
  reports = Reports()
  old = _watches(job[:2], reports, 1.0, token="old")  # an earlier job's keys under another token
  old[1].start()
  time.sleep(0.2)
  old[1].stop(exiting=True)
  ws = _watches(job, reports, 1.0, token="new")
  for w in ws:
    w.start()
  time.sleep(2.5)  # two and a half windows
  assert reports.got == []
  for w in ws:
    w.stop(exiting=False)
    w.join(2)
