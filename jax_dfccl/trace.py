"""Export of the runtimes' per-collective events as a Perfetto / Chrome trace.

Enable recording with ``jax_dfccl.configure(trace=True)``; run the program;
then ``jax_dfccl.export_trace("trace.json")`` and open it in ui.perfetto.dev.
Each device is a track; each collective instance a slice from its first
``run`` to ``finish``, with instant events at ``preempt`` and ``resume``.  On
GPU a second track per device shows XLA's stream: each submit kernel (from
entering to publishing the task; the inline kernel runs the task's lane in it)
and each wait (from reaching its done to seeing it complete).
"""
from __future__ import annotations

import json

from jax_dfccl._src import backend


def records() -> list[tuple]:
  """All events: (platform, device, key, seq, event, t_ns), time-sorted."""
  out = []
  for plat, recs in backend.trace_records().items():  # the cuda list includes the fused overlap ops'
    out.extend((plat, *r) for r in recs)
  out.sort(key=lambda r: r[5])
  return out


# GPU: slices on a device's "XLA stream" track, by (first event, last event):
# the submit kernel until it published the task, the inline submit kernel's run
# of the lane (xla_ffi/device/task.h, "inline"), the stream blocked on its done;
# and the inline kernel's single steps as instants there.
_STREAM_SLICES = {"submit_enter": ("submit_published", "submit"), "inline_lane": ("lane_fenced", "lane"),
                  "stream_wait": ("stream_woke", "wait")}
_STREAM_ENDS = {end: (begin, label) for begin, (end, label) in _STREAM_SLICES.items()}
_STREAM_INSTANTS = ("lane_entered", "lane_ready", "lane_polled", "lane_combined", "inline_completed")


def to_chrome_trace(recs) -> dict:
  events, open_ = [], {}
  t0 = recs[0][5] if recs else 0
  for plat, dev, key, seq, ev, t in recs:
    us = (t - t0) / 1e3
    pid, tid, name = plat, int(dev), f"{key}#{seq}"
    ident = (plat, dev, key, seq)
    if ev in _STREAM_SLICES:
      open_[(*ident, ev)] = us
    elif ev in _STREAM_ENDS:
      begin, label = _STREAM_ENDS[ev]
      b = open_.pop((*ident, begin), None)
      if b is not None:
        events.append(dict(name=f"{label} {name}", ph="X", pid=pid, tid=f"{dev} XLA stream", ts=b,
                           dur=max(us - b, 0.001), args={"seq": seq}))
    elif ev in ("start", "submit_matched"):
      events.append(dict(name=name, ph="i", s="t", pid=pid, tid=tid, ts=us, args={"event": ev}))
    elif ev in _STREAM_INSTANTS:
      events.append(dict(name=f"{ev} {name}", ph="i", s="t", pid=pid, tid=f"{dev} XLA stream", ts=us))
    elif ev in ("run", "resume"):
      open_[ident] = us
    elif ev in ("preempt", "finish", "error"):
      b = open_.pop(ident, None)
      if b is not None:
        events.append(dict(name=name, ph="X", pid=pid, tid=tid, ts=b, dur=max(us - b, 0.001),
                           args={"ended_by": ev, "seq": seq}))
      if ev != "finish":
        events.append(dict(name=f"{ev} {name}", ph="i", s="t", pid=pid, tid=tid, ts=us))
  return {"traceEvents": events, "displayTimeUnit": "ns"}


def export_trace(path: str) -> int:
  """Writes the runtimes' recorded events to ``path`` as a Chrome trace; returns the event count.

  The runtimes record events (start, preemption, resumption, end of each collective
  instance, per device) while ``jax_dfccl.config.trace`` is on; open the file in
  ``chrome://tracing`` or Perfetto to see which rank waited for which key.

  Args:
    path: the file to write (JSON, Chrome trace event format).

  Returns:
    The number of events written.

  Raises:
    OSError: ``path`` cannot be written.

  Example:
    >>> import os, tempfile
    >>> mesh = jax.sharding.Mesh(jax.devices(), ("x",))
    >>> f = jax.jit(jax.shard_map(lambda v: jax_dfccl.psum(v, "x"), mesh=mesh,
    ...                           in_specs=P("x"), out_specs=P()))
    >>> with jax_dfccl.configured(trace=True):
    ...   _ = f(jnp.arange(8.0)).block_until_ready()
    >>> path = os.path.join(tempfile.mkdtemp(), "trace.json")
    >>> jax_dfccl.export_trace(path) > 0
    True
  """
  tr = to_chrome_trace(records())
  with open(path, "w") as f:
    json.dump(tr, f)
  return len(tr["traceEvents"])
