"""``python -m jax_dfccl.demo``: what jax_dfccl shows where it runs, against jax.lax.

On CPU it starts two processes of a ``jax.distributed`` job on this host (a
loopback coordinator on a free port, one CPU device each), three times:

* **a stuck rank, jax.lax**: after a first step, process 1 stays alive but never
  starts the next ``psum`` (a stuck data loader, say); process 0 waits in it.
  XLA's CPU collectives (gloo) wait on, and nothing names the missing rank; the
  demo kills both processes after a few seconds and says what it saw.
* **a stuck rank, jax_dfccl**: the same program with ``jax_dfccl.psum`` and
  ``jax_dfccl.configure(timeout_s=...)``: process 0 fails after ``timeout_s``
  with an error naming the key, the missing rank and its process, and
  ``jax_dfccl.pending()``, called from a thread of either process while process
  0 waits, shows the instance and who has not started it.
* **programs that differ per process (MPMD)**: process 0 and process 1 run
  different programs that exchange arrays through ``jax_dfccl.send`` /
  ``recv``, started in a different order in each; the values are checked
  exactly.  jax.lax's collectives belong to one program that every process runs.

Where JAX sees two or more GPUs, it also runs the rank-specific order that
deadlocks jax.lax on GPUs: every rank starts eight collectives in its own order
(jax.lax in a child process killed after a timeout).

The demo prints a table (each row says in two lines what it proves) and exits
with 1 if a row does not show what it claims.  ``--json`` also prints the rows
as one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

TIMEOUT_S = 3.0      # jax_dfccl.config.timeout_s in the stuck-rank row
LAX_WAIT_S = 8.0     # how long the jax.lax stuck-rank row waits before it kills its processes
JOB_DEADLINE_S = 90  # any two-process job, start-up included
KEY = "step/grads"   # the stuck collective's key
CHAOS_ITERS = 20
CHAOS_LAX_TIMEOUT_S = 30


# ---- the processes of a job ------------------------------------------------------------------------
def _child_env(cpu: bool = True) -> dict:
  """The environment of a child that imports this jax_dfccl (an installed package or a source tree
  with its extension modules), on CPU devices if ``cpu``."""
  import jax_dfccl
  where = os.path.dirname(os.path.dirname(os.path.abspath(jax_dfccl.__file__)))
  env = dict(os.environ, PYTHONUNBUFFERED="1",
             PYTHONPATH=os.pathsep.join([where, os.environ.get("PYTHONPATH", "")]))
  if cpu:
    env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  return env


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _report(kind: str, **fields) -> None:
  print(f"{kind} " + json.dumps(fields), flush=True)


def _parse(out: str, kind: str):
  line = next((l for l in out.splitlines() if l.startswith(kind + " ")), None)
  return json.loads(line[len(kind) + 1:]) if line else None


def _job(role: str, kill_after: tuple[str, float] | None = None) -> tuple[list[str], list[int | None], float]:
  """Runs ``role`` in two processes; returns their outputs, exit codes (None: killed) and seconds.
  ``kill_after=(marker, s)``: kill both ``s`` seconds after process 0 printed a line starting with
  ``marker`` (or at the deadline)."""
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-P", "-m", "jax_dfccl.demo", "--child", role, str(p), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_child_env())
           for p in range(2)]
  outs: list[list[str]] = [[], []]
  marked = threading.Event()
  marker = kill_after[0] if kill_after else None

  def read(i):
    for line in procs[i].stdout:
      outs[i].append(line)
      if i == 0 and marker and line.startswith(marker):
        marked.set()
  readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
  for r in readers:
    r.start()
  t0 = time.monotonic()
  killed = [False, False]
  try:
    if kill_after:
      while not marked.is_set() and procs[0].poll() is None and time.monotonic() - t0 < JOB_DEADLINE_S:
        marked.wait(0.1)
      end = min(time.monotonic() + kill_after[1], t0 + JOB_DEADLINE_S) if marked.is_set() else time.monotonic()
    else:
      end = t0 + JOB_DEADLINE_S
    for i, p in enumerate(procs):
      try:
        p.wait(timeout=max(0.0, end - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
  finally:
    for i, p in enumerate(procs):
      if p.poll() is None:
        killed[i] = True
        p.kill()
      p.wait()
  for r in readers:
    r.join(5)
  codes = [None if k else p.returncode for k, p in zip(killed, procs)]
  return ["".join(o) for o in outs], codes, time.monotonic() - t0


def _exit_with_parent() -> None:
  """A child (stuck on purpose, or waiting in a collective) exits when the demo that started it is gone."""
  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(0.5)
    os._exit(3)
  threading.Thread(target=watch, daemon=True, name="demo-parent-watch").start()


def _start_process(process: int, port: str, timeout_s: float | None = None):
  import jax
  jax.config.update("jax_num_cpu_devices", 1)
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process)
  if timeout_s is not None:
    import jax_dfccl
    jax_dfccl.configure(timeout_s=timeout_s)
    jax_dfccl.initialize()
  return jax


def _psum_program(lib: str, key: str):
  """A jitted psum over both processes' devices, and its input."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_dfccl
  mesh = Mesh(np.array(jax.devices()), ("x",))
  if lib == "lax":
    body = lambda v: jax.lax.psum(v, "x")  # noqa: E731
  else:
    body = lambda v: jax_dfccl.psum(v, "x", key=key)  # noqa: E731
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  xs = np.ones((2, 4), np.float32)
  x = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, P("x")), lambda i: xs[i])
  return f, x


def _clear_failed_tokens(jax) -> None:
  # A program that failed leaves its error in JAX's runtime tokens, which jax's exit
  # handler would raise before it shuts jax.distributed down.
  try:
    jax.effects_barrier()
  except Exception:  # noqa: BLE001
    pass


def _child_lax_stuck(process: int, port: str) -> None:
  jax = _start_process(process, port)
  f, x = _psum_program("lax", KEY)
  f(x).block_until_ready()  # step 0: both processes (the collectives' context now exists)
  if process == 1:  # alive, never starts step 1
    _report("STUCK")
    time.sleep(10 * JOB_DEADLINE_S)
    return
  _report("WAITING")
  t0 = time.monotonic()
  try:
    f(x).block_until_ready()
    _report("RESULT", outcome="completed", seconds=time.monotonic() - t0)
  except Exception as e:  # noqa: BLE001
    _report("RESULT", outcome="error", error=str(e).strip()[:600], seconds=time.monotonic() - t0)
  _clear_failed_tokens(jax)
  os._exit(0)  # the peer is stuck: do not wait for it at shutdown


def _child_dfccl(process: int, port: str) -> None:
  jax = _start_process(process, port, TIMEOUT_S)
  import jax_dfccl
  from jax._src import distributed
  client = distributed.global_state.client
  res: dict = {"process": process, "mpmd": _mpmd(jax, process)}

  # The stuck rank: step 0 on both processes, then process 1 never starts step 1.
  f, x = _psum_program("dfccl", KEY)
  f(x).block_until_ready()
  client.wait_at_barrier("demo/step0", 60_000)
  reports: list[str] = []
  t = threading.Timer(1.5, lambda: reports.append(jax_dfccl.pending()))
  t.start()
  if process == 0:
    t0 = time.monotonic()
    try:
      f(x).block_until_ready()
      res["stuck"] = {"outcome": "completed", "seconds": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001
      res["stuck"] = {"outcome": "error", "error": str(e).strip().splitlines()[0][:600],
                      "seconds": time.monotonic() - t0}
    _clear_failed_tokens(jax)
    client.key_value_set("demo/failed", "1")
  else:  # stuck (alive) until process 0 has failed
    client.blocking_key_value_get("demo/failed", int(JOB_DEADLINE_S * 1000))
    res["stuck"] = {"outcome": "never started"}
  t.join()
  res["stuck"]["pending"] = reports[0] if reports else ""
  _report("RESULT", **res)


def _mpmd(jax, process: int) -> dict:
  """Process 0 sends a = 2x and b = x + 7 and receives c; process 1 receives b and then a (the
  other order) and sends back c = a * b + 1: two different programs, checked exactly."""
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_dfccl as dfccl
  mine = jax.local_devices()
  peer = next(d for d in jax.devices() if d.process_index != process)
  mesh = Mesh(np.array(mine), ("l",))
  xs = np.arange(32, dtype=np.int32).reshape(4, 8)
  x = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, P()), lambda i: xs[i])
  zero = np.zeros_like(xs)

  if process == 0:
    def program(v):
      ha = dfccl.send_start(2 * v, peer, key="a")
      hb = dfccl.send_start(v + 7, peer, key="b")
      hc = dfccl.recv_start(zero, peer, key="c")
      dfccl.done(ha)
      dfccl.done(hb)
      return (dfccl.done(hc),)
    want = {"c": 2 * xs * (xs + 7) + 1}
  else:
    def program(v):
      hb = dfccl.recv_start(zero, peer, key="b")
      ha = dfccl.recv_start(zero, peer, key="a")
      a, b = dfccl.done(ha), dfccl.done(hb)
      c = a * b + 1
      dfccl.done(dfccl.send_start(c, peer, key="c"))
      return a, b
    want = {"a": 2 * xs, "b": xs + 7}
  f = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
  got = dict(zip(want, (np.asarray(y) for y in f(x))))
  return {"exact": all(np.array_equal(got[k], want[k]) for k in want), "checked": sorted(want)}


# ---- the rows ---------------------------------------------------------------------------------------
class Row:
  """One row of the table: ``shown`` says whether the run showed what ``proves`` claims; ``evidence``
  holds what the processes reported (printed under the table and in ``--json``)."""

  def __init__(self, scenario, lib, result, shown, proves, evidence=None):
    self.scenario, self.lib, self.result, self.shown, self.proves = scenario, lib, result, shown, proves
    self.evidence = evidence or {}

  def as_dict(self) -> dict:
    return {"scenario": self.scenario, "collectives": self.lib, "result": self.result, "shown": self.shown,
            "proves": list(self.proves), "evidence": self.evidence}


def _lax_stuck_row() -> Row:
  outs, codes, _ = _job("lax-stuck", kill_after=("WAITING", LAX_WAIT_S))
  r = _parse(outs[0], "RESULT")
  waited = _parse(outs[0], "WAITING") is not None and _parse(outs[1], "STUCK") is not None
  evidence = {"waited_s": LAX_WAIT_S, "killed": codes[0] is None, "outcome": r}
  if r is None and waited and codes[0] is None:
    result, shown = f"still waiting after {LAX_WAIT_S:.0f} s, no error; killed", True
  elif r and r["outcome"] == "error":
    err = r["error"].splitlines()[0]
    names = "process 1" in err or "task 1" in err or "rank 1" in err
    result, shown = f"failed after {r['seconds']:.0f} s: {err[:40]}", not names
  else:
    result, shown = "unexpected (see the output)", False
    evidence["output"] = outs[0][-1000:]
  return Row("stuck rank", "jax.lax (gloo)", result, shown,
             ("process 1, alive, never starts step 1: process 0 waits on, and nothing",
              "names the missing rank or process (a hang to find by hand)"), evidence)


def _dfccl_rows() -> list[Row]:
  outs, codes, _ = _job("dfccl")
  res = [_parse(o, "RESULT") for o in outs]
  if any(r is None for r in res) or any(codes):
    tail = "\n".join(f"--- process {i} (exit {c}):\n{o[-2000:]}" for i, (c, o) in enumerate(zip(codes, outs)))
    print(f"the jax_dfccl processes failed:\n{tail}", file=sys.stderr)
    bad = f"processes failed (exit codes {codes})"
    return [Row("stuck rank", "jax_dfccl", bad, False, ("", "")),
            Row("MPMD send/recv", "jax_dfccl", bad, False, ("", ""))]
  evidence = {"timeout_s": TIMEOUT_S, "key": KEY, "error": res[0]["stuck"].get("error", ""),
              "seconds": res[0]["stuck"].get("seconds"), "pending": [r["stuck"]["pending"] for r in res]}
  s0 = res[0]["stuck"]
  err = s0.get("error", "")
  names = f"'{KEY}'" in err and "1 (device" in err and "process 1" in err
  in_time = s0["outcome"] == "error" and s0["seconds"] < TIMEOUT_S + 2.0
  pend = [r["stuck"]["pending"] for r in res]
  seen = all(f"'{KEY}'" in p and "not by [1 (device" in p for p in pend)
  took = f"{s0['seconds']:.1f} s" if "seconds" in s0 else "-"
  result = (f"error in {took} (timeout_s={TIMEOUT_S:g}) naming them" if names and in_time else
            f"{s0['outcome']} in {took}; names key, rank, process: {'yes' if names else 'NO'}")
  if not seen:
    result += "; pending() did NOT show it"
  stuck = Row("stuck rank", "jax_dfccl", result, names and in_time and seen,
              ("the same program fails within timeout_s naming the key, the missing rank and its process;",
               "pending(), from a thread of either process, shows the instance and who has not started it"),
              evidence)
  stuck.details = [f"process 0's error: {err}"] + [
      line for i in range(2) for line in
      [f"pending() in process {i} while process 0 waited:", *("    " + l for l in pend[i].strip().splitlines()[:6])]]
  exact = all(r["mpmd"]["exact"] for r in res)
  mpmd = Row("MPMD send/recv", "jax_dfccl", "exact" if exact else "WRONG values", exact,
             ("two programs, one per process, exchange arrays by send/recv started in different orders",
              "(matched by key, not by order); jax.lax collectives need one program on every process"),
             {"processes": [r["mpmd"] for r in res]})
  return [stuck, mpmd]


def _chaos_rows() -> list[Row]:
  """GPUs: the rank-specific order of eight collectives, jax_dfccl in this process, jax.lax in a child."""
  import numpy as np
  from jax_dfccl import testing as T
  mesh = _gpu_mesh()
  xs = T.chaos_inputs(mesh, "x")
  ref = T.reference_program(mesh, "x", CHAOS_ITERS)(*xs)
  ours = T.chaos_program(mesh, "x", CHAOS_ITERS)(*xs)
  exact = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(ours, ref))
  try:
    env = {**_child_env(cpu=False), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # the parent holds memory
    p = subprocess.run([sys.executable, "-P", "-m", "jax_dfccl.demo", "--child", "lax-chaos", "0", "0"],
                       env=env, capture_output=True, text=True, timeout=CHAOS_LAX_TIMEOUT_S)
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
    lax = line[0].split()[1] if line else f"error (exit {p.returncode})"
  except subprocess.TimeoutExpired:
    lax = f"HANG (killed after {CHAOS_LAX_TIMEOUT_S} s)"
  n = mesh.shape["x"]
  what = f"rank-specific order ({n} GPUs)"
  return [
      Row(what, "jax.lax (NCCL)", lax, lax.startswith("HANG") or lax == "WRONG",
          (f"each rank issues {T.NUM} collectives in its own order: NCCL pairs them by issue order,",
           "so the ranks wait for each other forever (a deadlock) or pair the wrong ones"), {"outcome": lax}),
      Row(what, "jax_dfccl", "exact" if exact else "WRONG", exact,
          ("the same program with start/done keyed collectives completes, bit for bit",
           "equal to every rank issuing them in one order"), {"exact": exact}),
  ]


def _gpu_mesh():
  import jax
  import numpy as np
  from jax.sharding import Mesh
  return Mesh(np.array(jax.devices("gpu")), ("x",))


def _child_lax_chaos() -> None:
  import numpy as np
  from jax_dfccl import testing as T
  mesh = _gpu_mesh()
  xs = T.chaos_inputs(mesh, "x")
  out = T.chaos_program(mesh, "x", CHAOS_ITERS, lib="lax")(*xs)
  ref = T.reference_program(mesh, "x", CHAOS_ITERS)(*xs)
  ok = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(out, ref))
  print("RESULT", "exact" if ok else "WRONG", flush=True)


def _gpu_count() -> int:
  import jax
  try:
    return len(jax.devices("gpu"))
  except RuntimeError:
    return 0


def _print_table(rows: list[Row]) -> None:
  hdr = ("scenario", "collectives", "result")
  w = [max(len(h), *(len(getattr(r, a)) for r in rows)) for h, a in zip(hdr, ("scenario", "lib", "result"))]
  print("  ".join(h.ljust(x) for h, x in zip(hdr, w)) + "  shown")
  print("  ".join("-" * x for x in w) + "  -----")
  for r in rows:
    print("  ".join(c.ljust(x) for c, x in zip((r.scenario, r.lib, r.result), w)) + "  " +
          ("yes" if r.shown else "NO"))
    for line in r.proves:
      print(" " * (w[0] + 2) + "  " + line)
  print()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
  ap.add_argument("--child", nargs=3, metavar=("ROLE", "PROCESS", "PORT"), help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.child:
    _exit_with_parent()
    role, process, port = a.child[0], int(a.child[1]), a.child[2]
    {"lax-stuck": _child_lax_stuck, "dfccl": _child_dfccl,
     "lax-chaos": lambda p, q: _child_lax_chaos()}[role](process, port)
    return 0

  t0 = time.monotonic()
  print("two processes of a jax.distributed job on this host, one CPU device each ...", flush=True)
  rows = [_lax_stuck_row(), *_dfccl_rows()]
  gpus = _gpu_count()
  if gpus >= 2:
    rows += _chaos_rows()
  print(f"\njax_dfccl demo ({time.monotonic() - t0:.0f} s)\n")
  _print_table(rows)
  for r in rows:
    for line in getattr(r, "details", []):
      print(line)
  if gpus < 2:
    print("\n(with two or more GPUs the demo also runs the rank-specific order that deadlocks jax.lax)")
  if a.json:
    print("JSON " + json.dumps([r.as_dict() for r in rows]))
  return 0 if all(r.shown for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
