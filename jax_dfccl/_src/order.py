"""Program order of waits.

A wait (a done, a send/recv) holds its device's stream until the instance completes, and XLA
orders independent operations by data dependence only: it may hoist a done above a collective
traced after its start, which a peer running another program may need first (a deadlock across
programs).  So each wait is tied, by an optimization_barrier on its operands, after every
collective traced before it in the same trace: after the trace's last wait (itself tied after
everything before it) and the starts and blocking collectives traced since.

Starts are tied to nothing, and neither are blocking collectives (a start and its wait in one
call): tied in trace order, independent blocking collectives traced in a rank-specific order would
hold each rank's stream on the one it traced first while its peers wait for another (a cycle that
no runtime can break: the other instances' inputs are behind the wait on the same stream).  Left to
XLA, they run in the order of data dependence, which is the same on every rank when the ranks use
the results alike.  A program that needs a rank-specific order uses starts and dones.
"""
from __future__ import annotations

import jax
from jax._src import core


class _TraceOrder:
  __slots__ = ("trace", "wait", "starts")

  def __init__(self, trace):
    self.trace, self.wait, self.starts = trace, None, []  # the last wait's output; a start's since


_ORDER: dict[int, _TraceOrder] = {}  # id(trace) -> its order, for the traces being staged now


def _traced():
  """The current trace when it stages out a program (not an eager evaluation), else None."""
  tr = core.trace_ctx.trace
  return None if isinstance(tr, core.EvalTrace) else tr


def forget_finished_traces():
  """Drops the order of every trace that is not the current one or one of its parents: they are
  finished (their values are held until then; lowering calls this too)."""
  live, tr = set(), _traced()
  while tr is not None and not isinstance(tr, core.EvalTrace):
    live.add(id(tr))
    tr = getattr(tr, "parent_trace", None)
  for k in [k for k in _ORDER if k not in live]:
    del _ORDER[k]


def after_earlier(*xs):
  """``xs`` (a wait's operands), tied after the collectives traced before it in this trace."""
  tr = _traced()
  st = _ORDER.get(id(tr)) if tr is not None else None
  if st is None:
    return xs
  deps = [v for v in ([st.wait] if st.wait is not None else []) + st.starts
          if getattr(v, "_trace", None) is tr]
  if not deps:
    return xs
  return tuple(jax.lax.optimization_barrier((*xs, *deps))[:len(xs)])


def issued(out, wait: bool):
  """Records a collective's output ``out`` (a wait's result, or one output of a start) in the
  current trace's order."""
  tr = _traced()
  if tr is None or getattr(out, "_trace", None) is not tr:
    return
  forget_finished_traces()
  st = _ORDER.get(id(tr))
  if st is None:
    st = _ORDER[id(tr)] = _TraceOrder(tr)
  if wait:
    st.wait, st.starts = out, []
  else:
    st.starts.append(out)


def bind_blocking(prim, *args, **params):
  """``prim`` (a blocking collective) bound on ``args``, tied to nothing; recorded with the starts,
  so the waits traced after it are tied after it."""
  y = prim.bind(*args, **params)
  issued(y, wait=False)
  return y


def bind_wait(prim, *args, **params):
  """``prim`` (a waiting primitive) bound on ``args`` tied after the earlier collectives; its
  result recorded as this trace's last wait."""
  y = prim.bind(*after_earlier(*args), **params)
  issued(y, wait=True)
  return y
