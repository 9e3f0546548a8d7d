"""Liveness across hosts: which processes of a ``jax.distributed`` job are gone.

A process of another host has no pid this one can look at, so every process writes a
heartbeat (a counter) to the job's key-value store and reads everyone's in one call,
every ``config.lost_after_s / 8`` on a thread of its own.  A process whose counter has
not moved for ``lost_after_s``, or that wrote ``exit`` (at interpreter exit), is lost:
the GPU runtime is told its devices (``set_lost_devices``), and its pending collectives
with a rank there fail naming it (``Proxy::CheckPeersAlive``), long before
``timeout_s``.  The key-value store itself not answering for ``lost_after_s`` loses
process 0, which serves it.  A stuck but alive process keeps its heartbeat: it is
named at ``timeout_s``, as a rank that never started the collective.

The watch never blocks the runtime: it calls it only to report, and the runtime takes
no lock of a handler for it.
"""
from __future__ import annotations

import atexit
import threading
import time
from typing import Callable

_NS = "jax_dfccl/alive"


class Watch(threading.Thread):
  """The heartbeat and the watch of one process (started by ``jax_dfccl.initialize``).

  Args:
    client: the job's key-value client (``jax._src.distributed.global_state.client``).
    token: the job's jax_dfccl token (keys of an earlier job are never read).
    me: this process's index; nprocs: the job's processes.
    report: called once per lost process with (process, why).
    lost_after_s: silence after which a process is lost.
  """

  def __init__(self, client, token: str, me: int, nprocs: int, report: Callable[[int, str], None],
               lost_after_s: float):
    super().__init__(name="jax_dfccl-liveness", daemon=True)
    self._client, self._me, self._nprocs = client, me, nprocs
    self._dir = f"{_NS}/{token}"
    self._report = report
    self._lost_after = float(lost_after_s)
    self._period = max(self._lost_after / 8, 0.01)
    self._halt = threading.Event()
    self.lost: dict[int, str] = {}

  def run(self) -> None:
    count = 0
    start = answered = time.monotonic()
    last: dict[int, tuple[str, float]] = {}
    while not self._halt.wait(self._period if count else 0):
      count += 1
      now = time.monotonic()
      try:
        self._client.key_value_set(f"{self._dir}/{self._me}", str(count), allow_overwrite=True)
        seen = dict(self._client.key_value_dir_get(self._dir))
        answered = now
      except Exception as e:  # noqa: BLE001  (the store unreachable: its server, process 0, may be gone)
        if now - answered > self._lost_after and self._me != 0 and 0 not in self.lost:
          self._lose(0, f"the job's key-value store (served by process 0) has not answered for "
                     f"{now - answered:.1f} s ({type(e).__name__})")
        continue
      for p in range(self._nprocs):
        if p == self._me or p in self.lost:
          continue
        v = seen.get(f"{self._dir}/{p}")
        if v == "exit":
          self._lose(p, "its process exited")
        elif v is not None and (p not in last or last[p][0] != v):
          last[p] = (v, now)
        elif now - last.get(p, ("", start))[1] > self._lost_after * (1 if p in last else 4):
          self._lose(p, f"its process has not written its heartbeat for {self._lost_after:g} s "
                     "(jax_dfccl.config.lost_after_s): exited, hung up or unreachable")

  def _lose(self, p: int, why: str) -> None:
    self.lost[p] = why
    try:
      self._report(p, f"process {p} is lost: {why}")
    except Exception:  # noqa: BLE001  (the runtime gone at interpreter exit)
      pass

  def stop(self, exiting: bool = True) -> None:
    """Stops the heartbeat; ``exiting``: tells the others this process is gone."""
    self._halt.set()
    if exiting:
      try:
        self._client.key_value_set(f"{self._dir}/{self._me}", "exit", allow_overwrite=True)
      except Exception:  # noqa: BLE001  (the store may be gone first)
        pass


def start(client, token: str, me: int, nprocs: int, report: Callable[[int, str], None],
          lost_after_s: float) -> Watch:
  """Starts the watch of this process; it says ``exit`` when the interpreter exits."""
  w = Watch(client, token, me, nprocs, report, lost_after_s)
  w.start()
  atexit.register(w.stop)
  return w
