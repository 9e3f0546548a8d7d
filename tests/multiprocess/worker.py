"""One process of a multi-process test job (launched by harness.py).

    python worker.py SCENARIO PROCESS_ID PROCESSES PORT DEVICES OUT_DIR

Prints one line ``RESULT {json}`` (the checks it made) and writes the case
outputs to OUT_DIR/p<id>.npz.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

scenario, me, nprocs, port, ndev, out_dir = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                             int(sys.argv[5]), sys.argv[6])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", ndev)
# A job whose process died must let the others finish (and exit 0).  Only
# there: with it, the coordinator's process may shut down before the others.
jax.config.update("jax_enable_recoverability", scenario == "dead")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nprocs, process_id=me)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_dfccl as dc  # noqa: E402

TIMEOUT = float(os.environ.get("DFCCL_TEST_TIMEOUT_S", "60"))
dc.configure(timeout_s=TIMEOUT)
if scenario == "suite_hosts":  # each process a host: psum, all_gather, psum_scatter in two levels
  dc.config.testing.processes_per_host = 1
  dc.config.tuning.two_level_plans = True
if scenario != "noinit":
  dc.initialize()

result: dict = {"process": me}
devices = jax.devices()
n = len(devices)
by_proc = [sorted((d for d in devices if d.process_index == p), key=lambda d: d.id) for p in range(nprocs)]
mesh1 = Mesh(np.array(devices), ("x",))
mesh2 = Mesh(np.array(devices).reshape(nprocs, ndev), ("p", "d")) if ndev > 1 else None
local = Mesh(np.array(by_proc[me]), ("l",))


def make_input(x, mesh, spec):
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def smap(f, mesh, spec_in, spec_out, check_vma=True):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec_in, out_specs=spec_out, check_vma=check_vma))


def local_out(y):
  return [np.asarray(s.data) for s in sorted(y.addressable_shards, key=lambda s: s.device.id)]


# ---- scenarios ----------------------------------------------------------------------
def spmd():
  import cases
  res = cases.run(dc, mesh1, mesh2, n, jax.shard_map, make_input)
  f32 = lambda v: v.astype(np.float32) if v.dtype == jnp.bfloat16 else v  # noqa: E731  (npz has no bfloat16)
  np.savez(os.path.join(out_dir, f"p{me}.npz"),
           **{f"{k}/{i}": f32(v) for k, outs in res.items() for i, v in enumerate(outs) if v is not None})
  result["dtypes"] = {k: str(next(v for v in outs if v is not None).dtype) for k, outs in res.items()}


def mpmd_orders():
  """Each process runs its own program: the same four keyed collectives, started
  in a process-specific order and finished in another."""
  keys = ["a", "b", "c", "d"]
  rot = me % 4
  start_order = keys[rot:] + keys[:rot]
  if me % 2:
    start_order = start_order[::-1]
  x = np.arange(n * 2 * 3, dtype=np.float32).reshape(n * 2, 3)

  def body(v):
    hs = {}
    for k in start_order:
      w = v * (keys.index(k) + 1)
      hs[k] = dc.all_gather_start(w, "x", tiled=True, key=k) if k == "c" else dc.psum_start(w, "x", key=k)
    return tuple(dc.done(hs[k]) for k in reversed(start_order)), tuple(reversed(start_order))

  outs = {}
  f = jax.jit(jax.shard_map(lambda v: body(v)[0], mesh=mesh1, in_specs=P("x"), out_specs=P("x")))
  order = list(reversed(start_order))
  ys = f(make_input(x, mesh1, P("x")))
  ok = True
  blocks = x.reshape(n, 2, 3)
  for k, y in zip(order, ys):
    mult = keys.index(k) + 1
    want = (blocks.sum(0) * mult) if k != "c" else x * mult
    for s in y.addressable_shards:
      ok &= bool(np.allclose(np.asarray(s.data), want, rtol=1e-6))
    outs[k] = ok
  result["mpmd_orders"] = {"start_order": start_order, "ok": ok}


def waits_in_order():
  """Even processes start "A", run "B" and then wait for "A"; odd ones run "B" and then "A" on
  B's result.  An even process's wait for A must not run before its B (the odd processes start A
  only after B): each wait is tied after the collectives traced before it."""
  x = np.arange(n * 4, dtype=np.float32).reshape(n, 4) / 3
  if me % 2 == 0:
    def body(v):
      h = dc.psum_start(v, "x", key="A")
      b = dc.psum(v, "x", key="B")
      return dc.done(h) + b
  else:
    def body(v):
      return dc.psum(v + dc.psum(v, "x", key="B"), "x", key="A")
  y = smap(body, mesh1, P("x"), P("x"), check_vma=False)(make_input(x, mesh1, P("x")))
  s = x.astype(np.float64).sum(0)
  odd = sum(len(by_proc[p]) for p in range(1, nprocs, 2))
  want = s * (2 + odd) if me % 2 == 0 else s * (1 + odd)  # A = S + odd * S; even ones add B = S
  result["waits_in_order"] = {"ok": all(np.allclose(o[0], want, rtol=1e-5) for o in local_out(y))}


def p2p_chain():
  """Process p receives from p-1 (device j from device j), adds p, sends to
  p+1; then the gradient of the last process's loss flows back through the
  transposes (recv -> send back, send -> recv)."""
  prev = by_proc[me - 1] if me > 0 else None
  nxt = by_proc[me + 1] if me < nprocs - 1 else None
  x = (np.arange(ndev * 3, dtype=np.float32).reshape(ndev, 3) + 1) / 7
  xin = make_input(x, local, P("l"))
  zero = jnp.zeros((1, 3), jnp.float32)
  total = float(sum(range(nprocs)))

  def ct_after(out):
    # The cotangent of a send is zeros, which XLA could compute (and so start the
    # gradient's receive and wait for it) before the forward send: a cycle with
    # the next process's program.  Tie it after the send's result.
    return jax.lax.optimization_barrier((jnp.zeros_like(out), out))[0]

  if me == 0:
    def fwd(v):
      out = dc.send(v * 2, nxt, key="chain")
      return out
    def step(v):
      out, vjp = jax.vjp(fwd, v)
      return out, vjp(ct_after(out))[0]
  elif me < nprocs - 1:
    def fwd(z):
      return dc.send(dc.recv(z, prev, key="chain") + me, nxt, key="chain")
    def step(v):
      out, vjp = jax.vjp(fwd, zero)
      return out, vjp(ct_after(out))[0]
  else:
    def fwd(z):
      a = dc.recv(z, prev, key="chain") + me
      return jnp.sum(a ** 2), a
    def step(v):
      (l, a), vjp = jax.vjp(fwd, zero)
      return a, vjp((jnp.ones_like(l), jnp.zeros_like(a)))[0]

  f = smap(step, local, P("l"), (P("l"), P("l")), check_vma=False)
  a, g = f(xin)
  got_a, got_g = np.concatenate(local_out(a)), np.concatenate(local_out(g))
  if me == 0:  # d/dx sum((2x + total)^2) = 4 (2x + total)
    ok = bool(np.allclose(got_g, 4 * (2 * x + total), rtol=1e-6)) and not np.any(got_a)
  elif me == nprocs - 1:
    ok = bool(np.allclose(got_a, 2 * x + total, rtol=1e-6)) and not np.any(got_g)
  else:
    ok = not np.any(got_g)  # a middle stage's placeholder gets zeros
  # Start forms, the other direction: p sends to p-1, recv posted before anything else.
  src = by_proc[me + 1] if me < nprocs - 1 else None
  dst = by_proc[me - 1] if me > 0 else None

  def back(v):
    h = dc.recv_start(v, src, key="back") if src else None
    s = dc.send_start(v * (me + 1), dst, key="back") if dst else None
    r = dc.done(h) if h else v
    if s is not None:
      dc.done(s)
    return r
  r = np.concatenate(local_out(smap(back, local, P("l"), P("l"), check_vma=False)(xin)))
  ok2 = bool(np.allclose(r, x * (me + 2) if src else x))
  result["p2p_chain"] = {"ok": ok and ok2}


def mismatch():
  """One key, process-specific shapes: every process gets an error naming the key and two ranks."""
  x = np.ones((n * 2, 4), np.float32)
  cols = 2 if me == nprocs - 1 else 4
  f = smap(lambda v: dc.psum(v[:, :cols], "x", key="mm"), mesh1, P("x"), P("x"))
  try:
    f(make_input(x, mesh1, P("x"))).block_until_ready()
    result["mismatch"] = {"ok": False, "error": None}
  except Exception as e:  # noqa: BLE001
    msg = str(e)
    result["mismatch"] = {"ok": "'mm'" in msg and "mismatch" in msg and "rank" in msg, "error": msg[:300]}


def suite_hosts():
  """The SPMD cases; the stages each op was lowered into (their keys in the lowered
  program); a start form over a group in two levels is refused when lowered."""
  spmd()
  import re
  arr = make_input(np.ones((n, 8), np.float32), mesh1, P("x"))
  progs = {"psum": lambda v: dc.psum(v, "x", key="tl"),
           "all_gather": lambda v: dc.all_gather(v, "x", tiled=True, key="tl"),
           "psum_scatter": lambda v: dc.psum_scatter(v, "x", scatter_dimension=1, tiled=True, key="tl")}
  result["two_level_stages"] = {
      op: sorted(set(re.findall(r"tl/(host2|host|across)\b", smap(f, mesh1, P("x"), P("x")).lower(arr).as_text())))
      for op, f in progs.items()}
  f = smap(lambda v: dc.done(dc.psum_start(v, "x", key="s")), mesh1, P("x"), P("x"), check_vma=False)
  try:
    f(make_input(np.ones((n, 2), np.float32), mesh1, P("x")))
    result["start_refused"] = ""
  except ValueError as e:
    result["start_refused"] = str(e)


def suite():
  spmd()
  mpmd_orders()
  waits_in_order()
  p2p_chain()
  mismatch()


def dead():
  """The last process dies (SIGKILL) while the others wait in a collective it never starts."""
  f = smap(lambda v: dc.psum(v, "x", key="warm"), mesh1, P("x"), P("x"))
  g = smap(lambda v: dc.psum(v, "x", key="B"), mesh1, P("x"), P("x"))
  x = make_input(np.ones((n, 2), np.float32), mesh1, P("x"))
  for _ in range(2):
    x = f(x)
  x.block_until_ready()
  if me == nprocs - 1:
    print("DYING", flush=True)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
  t0 = time.monotonic()
  try:
    g(x).block_until_ready()
    result["dead"] = {"ok": False}
  except Exception as e:  # noqa: BLE001
    result["dead"] = {"error": str(e).splitlines()[0][:400], "seconds": time.monotonic() - t0}


def stuck():
  """The last process is alive but starts 'S' only after the others timed out."""
  g = smap(lambda v: dc.psum(v, "x", key="S"), mesh1, P("x"), P("x"))
  x = make_input(np.ones((n, 2), np.float32), mesh1, P("x"))
  reports = []
  threading.Timer(1.0, lambda: reports.append(dc.pending())).start()
  if me == nprocs - 1:
    time.sleep(TIMEOUT + 1.5)
  t0 = time.monotonic()
  try:
    g(x).block_until_ready()
    result["stuck"] = {"ok": False}
  except Exception as e:  # noqa: BLE001
    result["stuck"] = {"error": str(e).splitlines()[0][:400], "seconds": time.monotonic() - t0}
  result["stuck"]["pending"] = reports[0] if reports else ""


def abandon():
  """Process 0's program fails between a start and its done (its callback raises), RUNS times;
  the other processes start each instance only after that failure.  XLA has freed the failed
  program's buffers by then (process 0 fills fresh ones meanwhile): nothing may be written
  into them, and every other process's result is exact.  Then every process runs a healthy program."""
  from jax._src import distributed
  client = distributed.global_state.client
  runs = 12
  xs = np.arange(n * 64, dtype=np.float32).reshape(n, 64)
  x = make_input(xs, mesh1, P("x"))

  def cb(proc):
    if int(proc) == 0:
      raise RuntimeError("injected failure")

  def body(v):
    h = dc.all_gather_start(v * 2.0, "x", tiled=True, key="abandon/ag")
    # The barrier runs the start before the callback (XLA would schedule the callback first).
    h, proc = jax.lax.optimization_barrier((h, jax.lax.axis_index("x") // ndev))
    jax.debug.callback(cb, proc, ordered=False)
    return dc.done(h)[: v.shape[0]] + v
  f = smap(body, mesh1, P("x"), P("x"), check_vma=False)
  failed, exact, keeps = 0, 0, []
  for i in range(runs):
    if me == 0:
      try:
        f(x).block_until_ready()
      except Exception:  # noqa: BLE001
        failed += 1
      clear_failed_tokens()
      keeps += [jax.device_put(np.full((1, 64), 7.0, np.float32), d) for d in by_proc[0] for _ in range(4)]
      jax.block_until_ready(keeps)
      client.key_value_set(f"abandon/{i}", "failed")
    else:
      client.blocking_key_value_get(f"abandon/{i}", 60_000)
      outs = local_out(f(x))
      rows = [devices.index(d) for d in by_proc[me]]  # their places on the axis
      exact += all(np.array_equal(o, 2 * xs[:1] + xs[r:r + 1]) for o, r in zip(outs, rows))
  client.key_value_set(f"abandon/done/{me}", "1")
  for p in range(nprocs):
    client.blocking_key_value_get(f"abandon/done/{p}", 60_000)
  g = smap(lambda v: dc.psum(v, "x", key="abandon/after"), mesh1, P("x"), P("x"))
  after = all(np.array_equal(o, xs.sum(0, keepdims=True)) for o in local_out(g(x)))
  result["abandon"] = {"runs": runs, "failed": failed, "exact": exact, "after": after,
                       "keeps_intact": all(np.all(np.asarray(k) == 7.0) for k in keeps)}


def retry():
  """Process 0's program fails before its keyed psum (a host callback raises) while the other
  processes' run of the same program has started it; process 0 runs the program again at once.
  Its second run must not pair with their first: their first run fails, naming the key and
  that a peer's program failed, and their second run pairs with its second."""
  from jax._src import distributed
  client = distributed.global_state.client
  fail = [me == 0]

  def gate(v):
    if fail[0]:
      raise RuntimeError("injected failure before the start")
    return v

  def body(v):
    w = jax.pure_callback(gate, jax.ShapeDtypeStruct(v.shape, v.dtype), v)
    return dc.psum(w, "x", key="retry")
  f = smap(body, mesh1, P("x"), P("x"), check_vma=False)
  inputs = {0: [3.0, 103.0]}  # process 0: the failing run, then its second run
  runs = []
  f.lower(make_input(np.zeros((n, 1), np.float32), mesh1, P("x"))).compile()  # compiled before "about to run"
  for i, val in enumerate(inputs.get(me, [1.0, 2.0])):
    x = make_input(np.full((n, 1), val, np.float32), mesh1, P("x"))
    if me != 0:
      client.key_value_set(f"retry/{me}/{i}", "1")  # about to run (and start the psum)
    elif i == 1:  # the retry comes once every other process's first run has started the psum
      for p in range(1, nprocs):
        client.blocking_key_value_get(f"retry/{p}/0", 60_000)
      time.sleep(1.0)
    t0 = time.monotonic()
    try:
      runs.append({"values": sorted({float(o.ravel()[0]) for o in local_out(f(x))}),
                   "seconds": time.monotonic() - t0})
    except Exception as e:  # noqa: BLE001
      runs.append({"error": str(e).splitlines()[0][:600], "seconds": time.monotonic() - t0})
      clear_failed_tokens()
    fail[0] = False
  result["retry"] = {"runs": runs, "devices": [len(by_proc[p]) for p in range(nprocs)]}


def chaos_retry():
  """Randomized failures across processes: every process runs the same program RUNS times; in
  each run a host callback may raise before its keyed psum (or after it), independently per
  process (a seeded draw per process and run), and the process goes straight on to its next run.
  Run k's input on device d of process p is (k+1)*1000 + 10*p + d, so a run that returns without
  an error must return the sum of every rank's run-k input: any other value pairs runs that do
  not belong together (a silent wrong result).  Errors allowed: the injected ones, ABORTED "a
  peer's program failed", and DEADLINE_EXCEEDED in the last runs (a peer has stopped)."""
  import random
  runs_n = int(os.environ.get("DFCCL_CHAOS_RUNS", "24"))
  rng = random.Random(1000 + me)
  plan = [("before" if u < 0.2 else "after" if u < 0.3 else "") for u in (rng.random() for _ in range(runs_n))]
  where = [""]

  def gate(tag):
    def g(v):
      if where[0] == tag:
        raise RuntimeError(f"injected failure {tag} the start")
      return v
    return g

  def body(v):
    w = jax.pure_callback(gate("before"), jax.ShapeDtypeStruct(v.shape, v.dtype), v)
    y = dc.psum(w, "x", key="chaos_retry")
    return jax.pure_callback(gate("after"), jax.ShapeDtypeStruct(y.shape, y.dtype), y)
  f = smap(body, mesh1, P("x"), P("x"), check_vma=False)
  f.lower(make_input(np.zeros((n, 1), np.float32), mesh1, P("x"))).compile()
  ranks = [(p, d) for p in range(nprocs) for d in range(len(by_proc[p]))]
  runs = []
  for k in range(runs_n):
    where[0] = plan[k]
    x = make_input(np.array([[(k + 1) * 1000.0 + 10 * p + d] for p, d in ranks], np.float32), mesh1, P("x"))
    rec = {"k": k, "plan": plan[k]}
    try:
      rec["values"] = sorted({float(o.ravel()[0]) for o in local_out(f(x))})
      rec["want"] = sum((k + 1) * 1000.0 + 10 * p + d for p, d in ranks)
    except Exception as e:  # noqa: BLE001
      rec["error"] = str(e).splitlines()[0][:300]
      clear_failed_tokens()
    runs.append(rec)
  result["chaos_retry"] = {"runs": runs}


def smoke():
  f = smap(lambda v: dc.psum(v, "x"), mesh1, P("x"), P("x"))
  y = f(make_input(np.ones((n, 2), np.float32), mesh1, P("x")))
  result["smoke"] = {"ok": all(np.all(o == n) for o in local_out(y))}


def clear_failed_tokens():
  # A program that failed leaves its error in JAX's runtime tokens, which
  # jax's exit handler would raise before it shuts jax.distributed down.
  try:
    jax.effects_barrier()
  except Exception:  # noqa: BLE001
    pass


def noinit():
  """Without jax_dfccl.initialize(), a collective spanning processes is refused when lowered."""
  f = smap(lambda v: dc.psum(v, "x"), mesh1, P("x"), P("x"))
  g = smap(lambda v: dc.send(v, by_proc[1 - me], key="k"), local, P("l"), P("l"), check_vma=False)
  x = make_input(np.ones((n, 2), np.float32), mesh1, P("x"))
  errors = []
  for fn, arg in ((f, x), (g, make_input(np.ones((ndev, 2), np.float32), local, P("l")))):
    try:
      fn(arg)
      errors.append("")
    except RuntimeError as e:
      errors.append(str(e))
  result["noinit"] = errors


try:
  {"suite": suite, "suite_hosts": suite_hosts, "dead": dead, "stuck": stuck, "abandon": abandon, "retry": retry, "chaos_retry": chaos_retry,
   "smoke": smoke, "noinit": noinit}[scenario]()
except Exception:  # noqa: BLE001
  result["exception"] = traceback.format_exc()[-3000:]
clear_failed_tokens()
result["stats"] = {k: v for k, v in dc.stats()["cpu"].items() if k.startswith("shm_")}
print("RESULT " + json.dumps(result), flush=True)
if scenario == "dead":
  # With recoverability the coordinator's process does not wait for the others
  # at shutdown; exiting first would fail their disconnect (and abort them).
  from jax._src import distributed
  client = distributed.global_state.client
  if me == 0:  # the survivors say goodbye just before they disconnect
    for p in range(1, nprocs - 1):
      client.blocking_key_value_get(f"bye/{p}", 20_000)
    time.sleep(1.0)
  else:
    client.key_value_set(f"bye/{me}", "1")
    jax.distributed.shutdown()
