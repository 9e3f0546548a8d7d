"""One rank of the multi-process GPU tests (started by tools/mps_testbed.sh, which
sets DFCCL_TESTBED_RANK / _NPROC / _COORD): a mesh of one GPU per process, every
collective against numpy on the same inputs, programs that differ per process
(each process starts independent collectives in its own order), re-entry in a
fori_loop; with --case timeout, a collective one process never starts (the
other must fail naming the key and the missing rank); with --case mismatch, the
same key started with different shapes (both fail naming it and both ranks); with
--case killed, rank 1 is killed (SIGKILL) while collectives are in flight (rank 0
must fail naming the key and rank 1 within timeout_s + 1 s); with --case recover, the
programs after a timeout run exact; with --case slots, instances one rank starts ahead of a
peer that first waits on another do not starve that one of slots; with --case chaos, the time of
K psums in process-specific orders against one order (--keys, --reps); with --case direct,
every op at 64 KiB .. 16 MiB per rank (the direct path across processes; --config k=v,... sets
jax_dfccl.config entries for any case, e.g. direct=0 for the staged path; --case bench --profile
adds the device timeline of each chain, benchmarks/common.py kernel_timeline, and --keep-trace DIR
keeps the profiler's trace folders); with --case abandon, rank 0's program fails between a start and its
done and rank 1 starts the instance later (rank 0's refilled buffers touched? rank 1 exact?); with
--case retry, rank 0's program fails before a start rank 1 made, then both run again (what each run
returns or raises); with --case train, data-parallel SGD across the processes against the same model
trained on the whole batch in one process (losses, rtol 1e-5).  Prints one JSON line
``RESULT {...}``; exits non-zero on a wrong result."""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import time

faulthandler.dump_traceback_later(45, exit=False)  # a stuck rank shows where it is

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.2")
# Programs differ per process: XLA's autotuning shared across processes (by module
# fingerprint) would wait for modules the other processes never compile.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false"
if "--profile" in sys.argv:  # the profiled programs run as timed: from their command buffers
  os.environ["XLA_FLAGS"] += " --xla_enable_command_buffers_during_profiling=true"

import jax  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.append(ROOT)  # benchmarks.common, tools.device_timeline (after an installed jax_dfccl)

rank = int(os.environ["DFCCL_TESTBED_RANK"])
nproc = int(os.environ["DFCCL_TESTBED_NPROC"])
jax.distributed.initialize(os.environ["DFCCL_TESTBED_COORD"], nproc, rank)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_dfccl as d  # noqa: E402

if "--config" in sys.argv:  # jax_dfccl.config entries, e.g. spin_budget_us=5,max_blocks=4 (before initialize():
  from benchmarks.common import parse_config  # noqa: E402  # cross_host_transport is read there)
  d.configure(**parse_config(sys.argv[sys.argv.index("--config") + 1]))
d.initialize()
if "--inline-us" in sys.argv:
  d.configure(submit_inline_us=float(sys.argv[sys.argv.index("--inline-us") + 1]))
case = sys.argv[sys.argv.index("--case") + 1] if "--case" in sys.argv else "parity"
if "--watch" in sys.argv:  # every S seconds, the runtime's counters and errors (a stuck rank shows what it saw)
  import threading

  def _watch(period=float(sys.argv[sys.argv.index("--watch") + 1])):
    last, told = None, False
    while True:
      time.sleep(period)
      got = []  # stats() waits for the runtime lock: a thread blocked inside a CUDA call holds it
      threading.Thread(target=lambda: got.append(d.stats()["cuda"]), daemon=True).start()
      for _ in range(int(period * 10)):
        if got:
          break
        time.sleep(0.1)
      if not got:
        print("WATCH stats() blocked; PENDING", d.pending(), flush=True)
        continue
      st = got[0]
      now = {k: st[k] for k in ("started", "completed", "pending", "launches", "ranges_exported", "ranges_mapped")}
      print("WATCH", now, st["errors"][-4:], flush=True)
      if now["pending"] and (now["started"], now["completed"]) == last and not told:  # stuck: what is in flight, once
        print("PENDING", d.pending(), flush=True)
        told = True
      last = (now["started"], now["completed"])
  threading.Thread(target=_watch, daemon=True).start()
elems = int(sys.argv[sys.argv.index("--elems") + 1]) if "--elems" in sys.argv else 1024
devs = jax.devices()
n = len(devs)
mesh = Mesh(np.array(devs), ("x",))


def inputs(seed):
  full = np.stack([np.random.default_rng(seed + r).standard_normal(elems).astype(np.float32) for r in range(n)])
  arr = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("x")), lambda idx: full[idx])
  return full, arr


def smap(f, donate=False):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False),
                 donate_argnums=(0,) if donate else ())


def local(a):  # this process's shard, (1, ...)
  return np.asarray(a.addressable_shards[0].data)


out = {"rank": rank, "case": case, "ok": True, "checks": {}}


def starts_then_dones(v, order, suffix=""):
  """psum of v * (1 + i) for each key "name/i" of ``order``: every start in that order, then every
  done in it (so a process-specific ``order`` is the order the instances run in)."""
  hs = {k: d.psum_start(v * (1 + int(k.split("/")[1])), "x", key=k + suffix) for k in order}
  return sum(d.done(hs[k]) for k in order)


def check(name, got, want, tol=1e-5):
  err = float(np.max(np.abs(got.astype(np.float64) - want))) if want.size else 0.0
  good = bool(np.allclose(got, want, rtol=tol, atol=tol))
  out["checks"][name] = {"ok": good, "max_err": err}
  out["ok"] &= good


s0 = d.stats()["cuda"]["started"]
if case == "parity":
  full, x = inputs(1)
  check("psum", local(smap(lambda v: d.psum(v, "x"))(x))[0], full.sum(0))
  check("pmax", local(smap(lambda v: d.pmax(v, "x"))(x))[0], full.max(0))
  check("all_gather", local(smap(lambda v: d.all_gather(v[0], "x")[None])(x))[0], full)
  check("psum_scatter", local(smap(lambda v: d.psum_scatter(v[0], "x", tiled=True)[None])(x))[0],
        full.sum(0).reshape(n, -1)[rank])
  check("all_to_all", local(smap(lambda v: d.all_to_all(v[0].reshape(n, -1), "x", 0, 0, tiled=True).reshape(1, -1))(x))[0],
        np.concatenate([full[r].reshape(n, -1)[rank] for r in range(n)]))
  perm = [(i, (i + 1) % n) for i in range(n)]
  check("ppermute", local(smap(lambda v: d.ppermute(v, "x", perm))(x))[0], full[(rank - 1) % n])

  # Programs that differ per process: independent collectives started in a process-specific order.
  keys = [f"chaos/{i}" for i in range(8)]
  order = keys if rank == 0 else keys[::-1]

  def chaos(v):
    res = {}
    for k in order:
      res[k] = d.psum(v * (1 + int(k.split("/")[1])), "x", key=k)
    return sum(res[k] for k in keys)
  check("chaos_order", local(smap(chaos)(x))[0], full.sum(0) * sum(1 + i for i in range(8)), tol=1e-4)
  # Blocking collectives run in XLA's data-dependence order (the same on both processes here); a
  # process-specific order of the instances themselves is expressed with starts and dones, which
  # run in trace order: each process starts all eight in its order, then waits for them in it.
  if not d.config.tuning.two_level_plans:  # (there, start forms over groups in two levels are refused)
    check("chaos_order_async", local(smap(lambda v: starts_then_dones(v, order, "/async"))(x))[0],
          full.sum(0) * sum(1 + i for i in range(8)), tol=1e-4)
  import re  # (the stages the psum was lowered into: their keys in the lowered program)
  out["psum_stages"] = sorted(set(re.findall(r"two/(host2|host|across|piece\d+)\b", smap(
      lambda v: d.psum(v, "x", key="two")).lower(x).as_text())))

  def loop(v):
    return jax.lax.fori_loop(0, 10, lambda i, y: d.psum(y, "x", key="loop") / n, v)
  check("fori_reentry", local(smap(loop)(x))[0], np.mean(full, 0) if n > 1 else full[0])
  # (Their time against one order: --case chaos.)
  ran = d.stats()["cuda"]["started"] - s0
  out["started"] = int(ran)
  out["ok"] &= ran >= 6 + 8 + 8 + 10
  # Latency: a chain of 100 psums, per op.
  f = smap(lambda v: jax.lax.fori_loop(0, 100, lambda i, y: d.psum(y, "x", key="chain") * 0.5, v))
  f(x).block_until_ready()
  t0 = time.perf_counter()
  f(x).block_until_ready()
  out["us_per_op_fori_chain"] = (time.perf_counter() - t0) / 100 * 1e6
  if d.config.testing.processes_per_host:
    # Each process a host (--config processes_per_host=1): the group is matched by announcements,
    # where one collective carries at most a receive slot's section (64 KiB) of a rank's input: the
    # blocking forms of larger inputs run as several over pieces of it (lowering_plans._split_lowering), each
    # op exact at 1 MiB per rank; a start form above it is refused naming that when the program is
    # lowered, which shows the collectives above took that path.
    s1 = d.stats()["cuda"]["started"]
    bigfull = np.stack([np.random.default_rng(40 + r).standard_normal(1 << 18).astype(np.float32) for r in range(n)])
    xb = jax.make_array_from_callback(bigfull.shape, NamedSharding(mesh, P("x")), lambda idx: bigfull[idx])
    check("big_psum", local(smap(lambda v: d.psum(v, "x", key="big"))(xb))[0], bigfull.sum(0), tol=1e-4)
    check("big_all_gather", local(smap(lambda v: d.all_gather(v[0], "x")[None])(xb))[0], bigfull)
    check("big_psum_scatter", local(smap(lambda v: d.psum_scatter(v[0], "x", tiled=True)[None])(xb))[0],
          bigfull.sum(0).reshape(n, -1)[rank], tol=1e-4)
    check("big_all_to_all", local(smap(lambda v: d.all_to_all(v[0].reshape(n, -1), "x", 0, 0, tiled=True)
                                       .reshape(1, -1))(xb))[0],
          np.concatenate([bigfull[r].reshape(n, -1)[rank] for r in range(n)]))
    check("big_ppermute", local(smap(lambda v: d.ppermute(v, "x", perm))(xb))[0], bigfull[(rank - 1) % n])
    out["big_pieces_started"] = int(d.stats()["cuda"]["started"] - s1)
    out["ok"] &= out["big_pieces_started"] >= 5 * 16  # (1 MiB in pieces of at most 64 KiB: 16 per op at least)
    err = "" if not d.config.tuning.two_level_plans else "spans hosts (two levels: start forms refused)"
    try:
      if not err:
        smap(lambda v: d.done(d.psum_start(v, "x", key="too_big")))(xb).block_until_ready()
    except Exception as e:  # noqa: BLE001
      err = str(e)
    out["spans_hosts_refusal"] = err[:300]
    out["ok"] &= "spans hosts" in err
    from jax_dfccl._src import backend  # noqa: E402
    out["engine"] = backend.runtimes()["cuda"].daemon_engine()  # "stores", or "nvshmem" (cross_host_transport)
    out["ok"] &= out["engine"] == ("nvshmem" if d.config.cross_host_transport == "nvshmem" else "stores")
elif case == "direct":
  # Larger messages across processes: the direct path (each process maps the allocations that hold
  # the other's XLA buffers, runtime/ipc.h), every op at 64 KiB .. 16 MiB per rank against numpy, in a
  # fori_loop too (the same buffers again); with --config direct=0, the staged path on the same inputs.
  perm = [(i, (i + 1) % n) for i in range(n)]
  for nbytes in (65536, 1 << 20, 16 << 20):
    elems = nbytes // 4
    full, x = inputs(7)
    tag = f"_{nbytes}"
    out.setdefault("input_ptrs", {})[nbytes] = hex(x.addressable_shards[0].data.unsafe_buffer_pointer())
    print("INPUT", nbytes, out["input_ptrs"][nbytes], flush=True)  # (where a sanitizer's report points)
    check("psum" + tag, local(smap(lambda v: d.psum(v, "x"))(x))[0], full.sum(0), tol=1e-4)
    check("all_gather" + tag, local(smap(lambda v: d.all_gather(v[0], "x")[None])(x))[0], full)
    check("psum_scatter" + tag, local(smap(lambda v: d.psum_scatter(v[0], "x", tiled=True)[None])(x))[0],
          full.sum(0).reshape(n, -1)[rank], tol=1e-4)
    check("all_to_all" + tag,
          local(smap(lambda v: d.all_to_all(v[0].reshape(n, -1), "x", 0, 0, tiled=True).reshape(1, -1))(x))[0],
          np.concatenate([full[r].reshape(n, -1)[rank] for r in range(n)]))
    check("ppermute" + tag, local(smap(lambda v: d.ppermute(v, "x", perm))(x))[0], full[(rank - 1) % n])
    loop = smap(lambda v: jax.lax.fori_loop(0, 5, lambda i, y: d.psum(y, "x", key="dloop") / n, v))
    check("fori" + tag, local(loop(x))[0], np.mean(full, 0) if n > 1 else full[0], tol=1e-4)
  # ragged_all_to_all (the direct path only): rank r sends 2 + (r + j) % 3 rows of 16 KiB to rank j.
  from jax_dfccl.config import config as dconfig
  rows, cols = 16, 4096
  size = np.array([[2 + (q + j) % 3 for j in range(n)] for q in range(n)], np.int32)  # [src, dst]
  in_off = np.concatenate([np.zeros((n, 1), np.int32), np.cumsum(size, 1)[:, :-1]], 1).astype(np.int32)
  out_off = np.concatenate([np.zeros((1, n), np.int32), np.cumsum(size, 0)[:-1]], 0).astype(np.int32)  # [src, dst]
  operand = np.random.default_rng(9).standard_normal((n, rows, cols)).astype(np.float32)
  want = np.zeros((n, rows, cols), np.float32)
  for q in range(n):
    for j in range(n):
      want[j, out_off[q, j]:out_off[q, j] + size[q, j]] = operand[q, in_off[q, j]:in_off[q, j] + size[q, j]]
  per_rank = [operand, np.zeros_like(operand), in_off, size, out_off, size.T.copy()]
  args = [jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("x")), lambda idx, a=a: a[idx]) for a in per_rank]
  ragged = jax.jit(jax.shard_map(lambda *a: d.ragged_all_to_all(*(t[0] for t in a), axis_name="x")[None], mesh=mesh,
                                 in_specs=(P("x"),) * 6, out_specs=P("x"), check_vma=False))
  if dconfig.tuning.direct:
    check("ragged_all_to_all", local(ragged(*args))[0], want[rank])
  st = d.stats()["cuda"]
  out["started"] = int(st["started"] - s0)
  out["ranges_exported"] = int(st["ranges_exported"])
  out["ranges_mapped"] = int(st["ranges_mapped"])
  out["errors"] = st.get("errors", [])
  out["ok"] &= out["started"] >= 3 * 10
elif case == "bench":
  from benchmarks.common import donated_time, gpu_kernel_events, kernel_timeline
  # Per-op time of dependent psum chains (100 ops, unrolled and in a fori_loop), 4 KiB .. 16 MiB per rank.
  out["sizes"] = {}
  sizes = (sys.argv[sys.argv.index("--sizes") + 1] if "--sizes" in sys.argv else "4096,65536,1048576,16777216")
  for nbytes in map(int, sizes.split(",")):
    elems = nbytes // 4
    full, x = inputs(3)

    def chain(v, nbytes=nbytes):
      for i in range(100):
        v = d.psum(v, "x", key=f"u{nbytes}/{i}") * 0.5
      return v
    def fori_chain(v, nbytes=nbytes):
      return jax.lax.fori_loop(0, 100, lambda i, y: d.psum(y, "x", key=f"f{nbytes}") * 0.5, v)
    # A loop body as a model's: two matmuls and a tanh around the psum (a body of a few
    # instructions, as above, is below XLA's threshold for a command buffer,
    # --xla_gpu_graph_min_graph_size, 5 by default).
    w1 = jnp.asarray(np.random.default_rng(11).standard_normal((elems, 256)) / np.sqrt(elems), jnp.float32)
    w2 = jnp.asarray(np.random.default_rng(12).standard_normal((256, elems)) / 16, jnp.float32)

    def fori_mlp_chain(v, nbytes=nbytes):
      return jax.lax.fori_loop(0, 100, lambda i, y: d.psum(jnp.tanh(y @ w1) @ w2, "x", key=f"m{nbytes}") * 0.5, v)
    unrolled, fori, fori_mlp = smap(chain), smap(fori_chain), smap(fori_mlp_chain)
    donating = {"unrolled": smap(chain, donate=True), "fori": smap(fori_chain, donate=True),
                "fori_mlp": smap(fori_mlp_chain, donate=True)}
    row = {}
    for name, f in (("unrolled", unrolled), ("fori", fori), ("fori_mlp", fori_mlp)):
      f(x).block_until_ready()
      st0 = d.stats()["cuda"]
      ts = []
      for _ in range(3):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append((time.perf_counter() - t0) / 100 * 1e6)
      row[name + "_us"] = sorted(ts)[1]
      st1 = d.stats()["cuda"]  # host time per op in the handlers (their calls per op: 0 when replayed)
      ops = st1["started"] - st0["started"]
      row[name + "_handler_calls_per_op"] = (st1["host_calls"] - st0["host_calls"]) / max(ops, 1)
      row[name + "_host_start_us"] = st1["host_start_us"]
      row[name + "_host_streamop_us"] = st1["host_streamop_us"]
      # 8 executions enqueued before blocking (each on the last one's output): their host work
      # (the handlers XLA calls when it updates a command buffer) overlaps the device's.
      y = f(x)
      y.block_until_ready()
      st0 = d.stats()["cuda"]
      t0 = time.perf_counter()
      for _ in range(8):
        y = f(y)
      y.block_until_ready()
      row[name + "_pipelined_us"] = (time.perf_counter() - t0) / 800 * 1e6
      st1 = d.stats()["cuda"]
      calls = st1["host_calls"] - st0["host_calls"]
      row[name + "_pipelined_handler_calls_per_op"] = calls / 800
      # The handlers' own host time per call in this loop (XLA calls them when it re-captures a
      # command): the stats hold running means, so the loop's share comes from mean x count.
      total = lambda st, k: st[k] * st["host_calls"]  # noqa: E731  (blocking forms: every call is a start)
      if calls > 0:
        row[name + "_pipelined_handler_us_per_call"] = (total(st1, "host_start_us") - total(st0, "host_start_us")) / calls
        row[name + "_pipelined_launch_us_per_call"] = (total(st1, "host_streamop_us") - total(st0, "host_streamop_us")) / calls
      # The same, each execution donating its input and fed the last output (a training
      # step's buffers): parameter, result and temporaries stay put, so XLA replays its
      # command buffers without updating them (no handler runs).  Median of 3 rounds of 8
      # after a settling round; the handler calls counted over the timed rounds.
      fd = donating[name]
      settled, reps, depth, chain_ops = {}, 3, 8, 100  # chain_ops: collectives per execution
      t = donated_time(fd, y, reps=reps, depth=depth, on_settled=lambda: settled.update(d.stats()["cuda"]))
      row[name + "_donated_us"] = t / chain_ops * 1e6
      row[name + "_donated_handler_calls_per_op"] = ((d.stats()["cuda"]["host_calls"] - settled["host_calls"])
                                                     / (reps * depth * chain_ops))
      if "--profile" in sys.argv:
        # The device timeline of 4 executions enqueued ahead (jax.profiler): the submit kernel's
        # period, each kernel's duration and the idle gaps between consecutive kernels.
        import tempfile
        yd = fd(jnp.copy(y))
        for _ in range(8):  # settled, as above
          yd = fd(yd)
        for tag, g in (("_donated", fd), ("", f)):  # (the donated program first: on its settled buffer)
          tdir = tempfile.mkdtemp()
          with jax.profiler.trace(tdir):
            for _ in range(4):
              yd = g(yd)
            yd.block_until_ready()
          row[name + tag + "_timeline"] = kernel_timeline(gpu_kernel_events(tdir), "Submit")
          if "--keep-trace" in sys.argv:  # the trace folder itself (host and device events), for tools/
            import shutil
            shutil.copytree(tdir, os.path.join(sys.argv[sys.argv.index("--keep-trace") + 1],
                                               f"rank{rank}_{nbytes}_{name}{tag}"))
    got = local(fori(x))[0]
    want = full.sum(0)
    for _ in range(99):
      want = want * 0.5 * n
    want = want * 0.5
    check(f"chain_{nbytes}", got, want, tol=1e-3)
    out["sizes"][nbytes] = row
  if "--trace" in sys.argv:
    # Where a 4 KiB psum's time goes on this rank: the device trace of a chain of 32
    # blocking psums, each followed by a multiply as in the chains above, its last
    # execution of 20 (tools/device_timeline.py's legs).
    from jax_dfccl._src import backend
    from tools.device_timeline import chain_legs
    d.configure(trace=True)
    elems, nops = 1024, 32  # elems: the per-rank size inputs() reads (4 KiB of f32)
    _, x = inputs(5)

    def traced(v):
      for i in range(nops):
        v = d.psum(v, "x", key=f"tr/{i}") * (1.0 / n)
      return v
    f = smap(traced)
    y = f(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(20):
      y = f(y)
    y.block_until_ready()
    out["trace_us_per_op"] = (time.perf_counter() - t0) / (20 * nops) * 1e6
    out["legs"] = chain_legs(backend.runtimes()["cuda"], [f"tr/{i}" for i in range(nops)])
    d.configure(trace=False)
elif case == "bench_async":
  # Per-op time of the start/done forms against the blocking form, both in a donated fori_loop of
  # 100 dependent psums (the start's done right after it, and with a 256x256 matmul between them),
  # --sizes (bytes per rank), --forms (a subset of the three).  Checks the values too.
  from benchmarks.common import donated_time
  out["sizes"] = {}
  sizes = (sys.argv[sys.argv.index("--sizes") + 1] if "--sizes" in sys.argv else "4096,1048576,4194304")
  a = jnp.asarray(np.random.default_rng(5).standard_normal((256, 256)) / 16, jnp.float32)
  for nbytes in map(int, sizes.split(",")):
    el = nbytes // 4
    xs = np.random.default_rng(7).standard_normal((n, el)).astype(np.float32)
    xa = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, P("x")), lambda idx, xs=xs: xs[idx])
    forms = {
        "blocking": lambda i, y, k=f"b{nbytes}": d.psum(y, "x", key=k) * 0.5,
        "start_done": lambda i, y, k=f"s{nbytes}": d.done(d.psum_start(y, "x", key=k)) * 0.5,
        "start_matmul_done": lambda i, y, k=f"o{nbytes}": (lambda h, m: d.done(h) * 0.5 + 0.0 * m[0, 0])(
            d.psum_start(y, "x", key=k), jnp.tanh(a @ a)),
    }
    if "--forms" in sys.argv:  # a subset, e.g. --forms start_done
      keep = sys.argv[sys.argv.index("--forms") + 1].split(",")
      forms = {k: v for k, v in forms.items() if k in keep}
    row = {}
    for name, body in forms.items():
      print("FORM", name, nbytes, flush=True)  # a stuck rank's log says which form
      f1 = smap(lambda v, body=body: jax.lax.fori_loop(0, 1, body, v))
      check(f"{name}/{nbytes}", local(f1(xa))[0], xs.sum(0) * 0.5, tol=1e-4)
      f = smap(lambda v, body=body: jax.lax.fori_loop(0, 100, body, v), donate=True)
      row[name + "_donated_us"] = round(donated_time(f, xa, reps=7, depth=4) / 100 * 1e6, 2)
    out["sizes"][nbytes] = row
    print("ROW", nbytes, json.dumps(row), flush=True)
elif case == "chaos":
  # Time per program of K independent 4 KiB psums (start/done), started and awaited in
  # process-specific orders (rank 0 forward, rank 1 reversed) against one order on both;
  # the two programs take turns, medians of --reps runs each (every run awaited).
  K = int(sys.argv[sys.argv.index("--keys") + 1]) if "--keys" in sys.argv else 8
  reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 100
  full, x = inputs(7)
  keys = [f"ch/{i}" for i in range(K)]

  mine = keys if rank == 0 else keys[::-1]
  fs = {"chaos": smap(lambda v: starts_then_dones(v, mine)), "one_order": smap(lambda v: starts_then_dones(v, keys))}
  for name, f in fs.items():
    check(name, local(f(x))[0], full.sum(0) * sum(1 + i for i in range(K)), tol=1e-4)
  ts = {name: [] for name in fs}
  for _ in range(reps):
    for name, f in fs.items():
      t0 = time.perf_counter()
      f(x).block_until_ready()
      ts[name].append((time.perf_counter() - t0) * 1e6)
  out["keys"], out["reps"] = K, reps
  for name in fs:
    out[name + "_us"] = float(np.median(ts[name]))
  out["ratio"] = out["chaos_us"] / out["one_order_us"]
  out["config"] = {k: d.config.as_dict()[k] for k in ("spin_budget_us", "sticky_budget_us", "max_blocks", "small_lanes", "submit_inline_us")}
elif case == "timeout":
  d.configure(timeout_s=3.0)
  full, x = inputs(2)
  # Both processes lower a program over the group first (its memory is exchanged then).
  check("warm", local(smap(lambda v: d.psum(v, "x", key="warm"))(x))[0], full.sum(0))
  if rank == 0:
    err = ""
    try:
      smap(lambda v: d.psum(v, "x", key="lonely"))(x).block_until_ready()
      smap(lambda v: d.psum(v, "x", key="after"))(x).block_until_ready()
    except Exception as e:  # noqa: BLE001
      err = str(e)
    errs = d.stats()["cuda"]["errors"]
    out["error"] = err[:300]
    out["ok"] = any("lonely" in e and "never started" in e for e in errs)
    out["errors"] = errs[-2:]
  else:
    time.sleep(8)
elif case == "reset":
  # After a collective one rank never started (its tombstone stays in the tables), every process
  # calls reset(): sequence numbers restart, and the same key then runs exact on both ranks (an
  # instance of the generation before the reset never meets one of the generation after it).
  from jax._src import distributed as jd
  client = jd.global_state.client
  d.configure(timeout_s=2.0)
  full, x = inputs(8)
  check("warm", local(smap(lambda v: d.psum(v, "x", key="warm"))(x))[0], full.sum(0))
  lonely = smap(lambda v: d.psum(v, "x", key="lonely"))
  if rank == 0:
    try:
      lonely(x).block_until_ready()
      d.raise_if_failed()
      out["first"] = "returned"
    except Exception as e:  # noqa: BLE001
      out["first"] = str(e)[:200]
  client.wait_at_barrier("reset/failed", 60_000)
  time.sleep(1.5)  # (the home's verdict reaches rank 1's table)
  d.reset()
  client.wait_at_barrier("reset/done", 60_000)
  for it in range(2):
    err = ""
    try:
      got = local(lonely(x))[0]
      d.raise_if_failed()
      check(f"after_reset_{it}", got, full.sum(0))
    except Exception as e:  # noqa: BLE001
      err = str(e)[:300]
      out["ok"] = False
    out[f"after_reset_{it}_error"] = err
  out["ok"] &= rank != 0 or "lonely" in out.get("first", "")
elif case == "slots":
  # Rank 0 starts "A" and then "B"; rank 1, later, starts "B" first and "A" only after "B"
  # completed.  In the match table (--identity 0) with one small-message slot: neither of
  # rank 0's arrivals may take the pool's only slot (its reserve, device/match.cuh) before
  # rank 1 arrives, so B, which both arrive at, gets it, then A.  By identity (--identity 1,
  # device/task.h) with two slots, so that A and B share one bucket of two ways: rank 0's A
  # holds one way at rank 1 until rank 1 starts A, and B takes the other.  Both exact, no error.
  identity = int(sys.argv[sys.argv.index("--identity") + 1]) if "--identity" in sys.argv else 0
  slots = int(sys.argv[sys.argv.index("--small-slots") + 1]) if "--small-slots" in sys.argv else 1 + identity
  # Before the group's communicator is created (warm).
  d.configure(small_slots=slots, small_by_identity=bool(identity), timeout_s=20.0)
  full, x = inputs(8)
  check("warm", local(smap(lambda v: d.psum(v, "x", key="warm"))(x))[0], full.sum(0))
  if rank == 0:
    def prog(v):
      h = d.psum_start(v, "x", key="A")
      b = d.psum(v, "x", key="B")
      return d.done(h) + b
  else:
    time.sleep(1.5)  # rank 0 arrives at A and B first

    def prog(v):
      b = d.psum(v, "x", key="B")
      return d.psum(v + b, "x", key="A")
  s0 = d.stats()["cuda"]["started"]
  got = local(smap(prog)(x))[0]
  b = full.sum(0)  # B; A sums rank 0's v and rank 1's v + B, so A = 2B: rank 0 gets A + B, rank 1 A
  check("slots", got, 3 * b if rank == 0 else 2 * b, tol=1e-4)
  out["started"] = int(d.stats()["cuda"]["started"] - s0)
  out["errors"] = d.stats()["cuda"]["errors"][-2:]
  out["got_over_b"] = [float(v) for v in (got[:4] / b[:4])]  # 3 (rank 0) or 2 (rank 1) when exact
  out["ok"] &= out["started"] == 2 and not out["errors"]
elif case == "recover":
  # Faults, each followed by fresh programs on both ranks that must be exact
  # (nothing stale in the match table or the ring, no reset()): (a) rank 0 runs a
  # collective rank 1 never starts (timeout); (b) rank 1 starts it late (the failed
  # instance is a tombstone: it fails instead of waiting); (c) a mismatch; (d) a
  # host callback that fails on one rank between a start and its done.  Outside
  # command buffers: there a failure is an exception (raise_if_failed after the
  # step), inside one it traps the context (README, Limitations).
  from jax._src import distributed as jd
  client = jd.global_state.client
  d.configure(timeout_s=2.0)
  full, x = inputs(7)
  check("warm", local(smap(lambda v: d.psum(v, "x", key="warm"))(x))[0], full.sum(0))
  out["errors"], out["fault_seconds"] = {}, {}

  def fault(name, runs, raises, f, want):
    err, t0 = "", time.perf_counter()
    if rank in runs:
      try:
        f(x).block_until_ready()
        d.raise_if_failed()
      except Exception as e:  # noqa: BLE001
        err = str(e)[:300]
      out["errors"][name] = err
      out["fault_seconds"][name] = round(time.perf_counter() - t0, 2)
      out["ok"] &= (want in err) if rank in raises else not err
    client.wait_at_barrier(f"recover/{name}", 60_000)
    for it in range(2):
      got = local(smap(lambda v: d.psum(v * 2, "x", key=f"fresh/{name}") + d.pmax(v, "x", key=f"fresh/{name}/max"))(x))[0]
      d.raise_if_failed()
      check(f"{name}_fresh_{it}", got, 2 * full.sum(0) + full.max(0))
    client.wait_at_barrier(f"recover/{name}/fresh", 60_000)

  lonely = smap(lambda v: d.psum(v, "x", key="lonely"))
  try:
    fault("timeout", {0}, {0}, lonely, "'lonely'")
    fault("late_rank", {1}, {1}, lonely, "'lonely'")
    fault("mismatch", {0, 1}, {0, 1},
          smap(lambda v: d.psum(v if rank == 0 else v[:, : elems // 2], "x", key="mm")[:, :1]), "'mm'")

    # A host callback that fails on rank 0 between a start and its done: rank 0's
    # program fails; the collective itself completes (both ranks started it).
    def boom(v):
      if rank == 0:
        raise RuntimeError("callback failed on purpose")
      return v

    def with_callback(v):
      h = d.psum_start(v, "x", key="cb")
      y = jax.pure_callback(boom, jax.ShapeDtypeStruct(v.shape, v.dtype), v)
      return d.done(h) + 0 * y
    fault("callback", {0, 1}, {0}, smap(with_callback), "CpuCallback error")  # XLA's error for a failed callback
  except Exception as e:  # noqa: BLE001 - a fresh program failed
    out["ok"], out["error"] = False, str(e)[:400]
elif case == "mismatch":
  d.configure(timeout_s=20.0)
  full, x = inputs(4)
  check("warm", local(smap(lambda v: d.psum(v, "x", key="warm"))(x))[0], full.sum(0))
  # Rank 1 starts "mm" on half of its shard: same key and sequence, another shape.
  f = smap(lambda v: d.psum(v if rank == 0 else v[:, : elems // 2], "x", key="mm")[:, :1])
  err, t0 = "", time.perf_counter()
  try:
    f(x).block_until_ready()
  except Exception as e:  # noqa: BLE001
    err = str(e)
  out["seconds"] = time.perf_counter() - t0
  errs = d.stats()["cuda"]["errors"]
  out["error"], out["errors"] = err[:400], errs[-2:]
  out["ok"] = any("'mm'" in e and "rank 0" in e and "rank 1" in e for e in errs) and out["seconds"] < 20
elif case == "killed":
  import signal
  import threading
  timeout_s = 5.0
  d.configure(timeout_s=timeout_s)
  full, x = inputs(5)
  check("warm", local(smap(lambda v: d.psum(v, "x", key="warm"))(x))[0], full.sum(0))
  f = smap(lambda v: jax.lax.fori_loop(0, 50, lambda i, y: d.psum(y, "x", key="victim") * 0.5, v))
  f(x).block_until_ready()
  stamp = os.path.join(os.environ["DFCCL_TESTBED_TMP"], "killed_at")
  if rank == 1:
    def die():
      time.sleep(1.0)
      with open(stamp + ".tmp", "w") as fh:
        fh.write(repr(time.time()))
      os.replace(stamp + ".tmp", stamp)
      os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=die, daemon=True).start()
  err, t_start = "", time.time()
  try:
    while time.time() - t_start < 60:  # until the peer dies
      f(x).block_until_ready()
  except Exception as e:  # noqa: BLE001
    err = str(e)
  t_err = time.time()
  killed_at = float(open(stamp).read()) if os.path.exists(stamp) else float("nan")
  errs = d.stats()["cuda"]["errors"]
  out["error"], out["errors"] = err[:400], errs[-2:]
  out["seconds_after_kill"] = t_err - killed_at
  # (a peer on this host by its pid; one of another host, simulated ones included, by the
  # liveness watch over the key-value store: jax_dfccl/_src/liveness.py)
  out["named_by"] = ("pid" if any("exited before it completed" in e for e in errs) else
                     "liveness" if any("was lost before it completed" in e for e in errs) else "other")
  out["ok"] = (any("'victim'" in e and "rank 1" in e for e in errs)
               and 0 <= out["seconds_after_kill"] <= timeout_s + 1)
elif case == "sendrecv":
  # send/recv between the processes' programs (different per process), each side
  # starting its transfers in its own order; the way back carries what came in + 1.
  me, peer = [dv for dv in devs if dv.process_index == rank][0], [dv for dv in devs if dv.process_index != rank][0]
  lmesh = Mesh(np.array([me]), ("p",))
  micro, width = 4, elems
  zeros = jnp.zeros((8, width), jnp.float32)

  def prog(v):
    if rank == 0:
      sends = [d.send_start(v * (m + 1), peer, key=f"a{m}") for m in range(micro)]
      backs = [d.recv_start(zeros, peer, key=f"b{m}") for m in reversed(range(micro))][::-1]
      got = [d.done(h) for h in backs]
      for h in sends:
        d.done(h)
      return jnp.stack(got)
    ins = [d.recv_start(zeros, peer, key=f"a{m}") for m in reversed(range(micro))][::-1]
    got = [d.done(h) for h in ins]
    sends = [d.send_start(g + 1, peer, key=f"b{m}") for m, g in enumerate(got)]
    for h in sends:
      d.done(h)
    return jnp.stack(got)

  f = jax.jit(jax.shard_map(prog, mesh=lmesh, in_specs=P(), out_specs=P(), check_vma=False))
  v = np.random.default_rng(6).standard_normal((8, width)).astype(np.float32)
  for it in range(3):
    res = np.asarray(f(jnp.asarray(v)))
    want = np.stack([v * (m + 1) + (1 if rank == 0 else 0) for m in range(micro)])
    check(f"sendrecv_{it}", res, want)
  out["started"] = int(d.stats()["cuda"]["started"] - s0)
  out["ok"] &= out["started"] >= 3 * 2 * micro
elif case == "train":
  # Data-parallel training across the processes (one GPU each): each rank's gradient of its
  # shard of the batch, averaged by psum (a key per parameter), 20 SGD steps of a two-layer MLP;
  # the losses against the same model trained on the whole batch in this process alone
  # (jax on this GPU, no collective), rtol 1e-5.
  jax.config.update("jax_default_matmul_precision", "highest")
  width, per, steps, lr = 32, 16, 20, 0.1
  rng = np.random.default_rng(21)
  params0 = (rng.standard_normal((width, width)).astype(np.float32) / np.sqrt(width),
             rng.standard_normal((width, 1)).astype(np.float32) / np.sqrt(width))

  def batch(t):  # the whole batch of step t: n shards of `per` rows
    r = np.random.default_rng(100 + t)
    xb = r.standard_normal((n * per, width)).astype(np.float32)
    return xb, np.sin(xb.sum(1, keepdims=True)).astype(np.float32)

  def loss_fn(ps, xb, yb):
    h = jnp.tanh(xb @ ps[0])
    return jnp.mean((h @ ps[1] - yb) ** 2)

  def dp_step(ps, xb, yb):  # one rank's shard: (per, width), (per, 1)
    ls, gs = jax.value_and_grad(loss_fn)(ps, xb, yb)
    gs = tuple(d.psum(g, "x", key=f"grad{i}") / n for i, g in enumerate(gs))
    return tuple(p_ - lr * g for p_, g in zip(ps, gs)), d.psum(ls, "x", key="loss") / n

  step = jax.jit(jax.shard_map(dp_step, mesh=mesh, in_specs=(P(), P("x"), P("x")), out_specs=(P(), P()),
                               check_vma=False))
  rep = NamedSharding(mesh, P())
  ps = tuple(jax.make_array_from_callback(p_.shape, rep, lambda idx, p_=p_: p_[idx]) for p_ in params0)
  losses = []
  for t in range(steps):
    xb, yb = batch(t)
    xa = jax.make_array_from_callback(xb.shape, NamedSharding(mesh, P("x")), lambda idx, xb=xb: xb[idx])
    ya = jax.make_array_from_callback(yb.shape, NamedSharding(mesh, P("x")), lambda idx, yb=yb: yb[idx])
    ps, ls = step(ps, xa, ya)
    losses.append(float(np.asarray(ls.addressable_shards[0].data)))
  local_dev = jax.local_devices()[0]
  ref_step = jax.jit(lambda ps, xb, yb: (lambda l, g: (tuple(p_ - lr * g_ for p_, g_ in zip(ps, g)), l))(
      *jax.value_and_grad(loss_fn)(ps, xb, yb)))
  rps, ref = jax.device_put(params0, local_dev), []
  for t in range(steps):
    xb, yb = batch(t)
    rps, ls = ref_step(rps, *jax.device_put((xb, yb), local_dev))
    ref.append(float(ls))
  got, want = np.array(losses), np.array(ref)
  out["losses"], out["reference"] = [round(v, 7) for v in losses], [round(v, 7) for v in ref]
  out["max_rel_err"] = float(np.max(np.abs(got - want) / np.abs(want)))
  out["ok"] &= bool(out["max_rel_err"] < 1e-5 and want[-1] < want[0])
  out["started"] = int(d.stats()["cuda"]["started"] - s0)
  out["ok"] &= out["started"] >= steps * 3
elif case == "abandon":
  # A program abandoned between a start and its done (issue 46): rank 0's program starts a
  # collective, then a host callback raises (ordered after the start by an optimization barrier,
  # and the done after the callback), so XLA frees that execution's buffers and never runs the
  # done; rank 0 then fills fresh buffers of the output's size with a sentinel (kept alive) and
  # only then (through the key-value store) rank 1 runs the same program, its start pairing with
  # rank 0's abandoned one.  Per op and size: how many of rank 0's sentinel buffers were changed,
  # and whether rank 1's result is exact.  --ops all_gather,psum  --sizes 4096,1048576,4194304
  # (bytes of each rank's input)  --runs 3  --timeout-s 6 (config.timeout_s: a rank 1 that finds
  # no partner fails after it).  One "PROBE {...}" line per run as it ends.
  from jax._src import distributed as jd
  client = jd.global_state.client
  argv = lambda k, v: sys.argv[sys.argv.index(k) + 1] if k in sys.argv else v  # noqa: E731
  ops = argv("--ops", "all_gather,psum").split(",")
  sizes = [int(v) for v in argv("--sizes", "4096,1048576,4194304").split(",")]
  runs = int(argv("--runs", "3"))
  d.configure(timeout_s=float(argv("--timeout-s", "6")))
  sentinel = np.float32(-7.25)  # the inputs are integers 1..997 (and their doubles, sums): never this
  mine = jax.local_devices()[0]
  full, x = inputs(2)  # the group's memory is exchanged when both ranks lower a program over it
  check("warm", local(smap(lambda v: d.psum(v, "x", key="warm"))(x))[0], full.sum(0))

  def fail_on_rank0(idx):
    if int(idx) == 0:
      raise RuntimeError("injected failure after the start")
    return np.float32(0)  # added to the result: XLA cannot drop the callback

  def program(op, tag):
    def body(v):
      w = v * 2.0  # a buffer of this execution (freed with it): the collective's input
      h = (d.all_gather_start(w, "x", tiled=True, key=tag) if op == "all_gather"
           else d.psum_start(w, "x", key=tag))
      h, idx = jax.lax.optimization_barrier((h, jax.lax.axis_index("x")))  # the start, then the callback
      y = jax.pure_callback(fail_on_rank0, jax.ShapeDtypeStruct((), jnp.float32), idx)
      h, y = jax.lax.optimization_barrier((h, y))  # the callback, then the done
      return d.done(h)[: v.shape[0]] + v + y
    return smap(body)

  keeps, probe = [], []
  for op in ops:
    for nbytes in sizes:
      el = nbytes // 4
      xs = (np.arange(n * el, dtype=np.float32).reshape(n, el) % 997) + 1
      xa = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, P("x")), lambda idx, xs=xs: xs[idx])
      want = (2 * xs[0] if op == "all_gather" else 2 * xs.sum(0)) + xs[rank]
      out_shape = (n * el,) if op == "all_gather" else (el,)
      out_bytes = 4 * int(np.prod(out_shape))
      count = int(max(8, min(256, (128 << 20) // out_bytes)))  # sentinel buffers per run
      tag = f"abandon/{op}/{nbytes}"
      f = program(op, tag)
      for i in range(runs):
        rec = {"op": op, "bytes": nbytes, "run": i, "rank": rank}
        t0 = time.perf_counter()
        if rank == 0:
          try:
            f(xa).block_until_ready()
            rec["error"] = ""  # (the callback should have raised)
          except Exception as e:  # noqa: BLE001
            rec["error"] = str(e).strip().splitlines()[0][:300]
            rec["injected"] = "injected failure after the start" in str(e)  # (the callback's, not a timeout)
          for fn in (d.raise_if_failed, jax.effects_barrier):
            try:
              fn()
            except Exception as e:  # noqa: BLE001
              rec.setdefault("after_errors", []).append(str(e).strip().splitlines()[0][:300])
          fill = np.full(out_shape, sentinel, np.float32)
          new = [jax.device_put(fill, mine) for _ in range(count)]
          jax.block_until_ready(new)
          keeps += new
          client.key_value_set(f"{tag}/{i}/failed", "1")
          client.blocking_key_value_get(f"{tag}/{i}/ran", 120_000)
          time.sleep(0.3)  # (rank 1's instance has completed or failed: the daemons are done with it)
          touched = []
          for j, k in enumerate(new):
            a = np.asarray(k)
            bad = np.flatnonzero(a != sentinel)
            if bad.size:
              touched.append({"index": j, "ptr": hex(k.unsafe_buffer_pointer()), "changed": int(bad.size),
                              "first": int(bad[0]), "values": [float(v) for v in np.unique(a[bad])[:4]]})
          ptrs = [k.unsafe_buffer_pointer() for k in new]
          rec.update(sentinels=count, sentinel_bytes=out_bytes, touched=len(touched), touched_detail=touched[:8],
                     sentinel_range=[hex(min(ptrs)), hex(max(ptrs) + out_bytes)])
          out["ok"] &= not touched
        else:
          client.blocking_key_value_get(f"{tag}/{i}/failed", 120_000)
          t0 = time.perf_counter()
          err, got = "", None
          try:
            got = local(f(xa))[0]
            d.raise_if_failed()
          except Exception as e:  # noqa: BLE001
            err = str(e).strip().splitlines()[0][:300]
          rec["error"] = err
          rec["exact"] = bool(got is not None and not err and np.array_equal(got, want))
          out["ok"] &= rec["exact"]
          if got is not None:  # wrong elements, and those whose rank-0 part (2 x0) read as the sentinel
            rec["wrong"] = int(np.sum(got != want))
            rec["from_sentinel"] = int(np.sum(got - (want - 2 * xs[0]) == sentinel))
          client.key_value_set(f"{tag}/{i}/ran", "1")
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        probe.append(rec)
        print("PROBE " + json.dumps(rec), flush=True)
  client.wait_at_barrier("abandon/runs", 120_000)
  if rank == 0:  # every sentinel buffer again: a late write into an earlier run's
    out["keeps_touched_at_end"] = int(sum(bool(np.any(np.asarray(k) != sentinel)) for k in keeps))
    out["keeps"] = len(keeps)
  try:  # then a healthy program on both ranks
    check("after", local(smap(lambda v: d.psum(v, "x", key="abandon/after"))(x))[0], full.sum(0))
    d.raise_if_failed()
  except Exception as e:  # noqa: BLE001
    out["ok"], out["after_error"] = False, str(e).strip().splitlines()[0][:300]
  out["probe"] = probe
  st = d.stats()["cuda"]
  out["errors"] = st.get("errors", [])[-6:]
  out["pending"] = int(st.get("pending", 0))
  client.wait_at_barrier("abandon/end", 120_000)
elif case == "chaos_retry":
  # Randomized failures across processes (as tests/multiprocess/worker.py chaos_retry on CPU):
  # RUNS runs of one program; a seeded draw per rank and run makes its host callback raise before
  # the keyed psum (20%) or after it (10%).  Run k's input on rank r is (k+1)*1000 + 10*r; a run
  # that ends without an error (raise_if_failed after it included: outside a command buffer a
  # failed collective's error comes at the next call) must return the sum over the ranks of run k.
  # --runs (24), --timeout-s (3).  Outside command buffers (inside, a failed collective traps).
  import random
  argv = lambda k, v: sys.argv[sys.argv.index(k) + 1] if k in sys.argv else v  # noqa: E731
  d.configure(timeout_s=float(argv("--timeout-s", "3")))
  runs_n = int(argv("--runs", "24"))
  rng = random.Random(1000 + rank)
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
    y = d.psum(w, "x", key="chaos_retry")
    return jax.pure_callback(gate("after"), jax.ShapeDtypeStruct(y.shape, y.dtype), y)
  f = smap(body)
  mk = lambda k: jax.make_array_from_callback(  # noqa: E731
      (n, 1), NamedSharding(mesh, P("x")), lambda idx: np.array([[(k + 1) * 1000.0 + 10 * r] for r in range(n)],
                                                                np.float32)[idx])
  f.lower(mk(0)).compile()
  runs, wrong = [], 0
  for k in range(runs_n):
    where[0] = plan[k]
    rec = {"k": k, "plan": plan[k]}
    try:
      d.raise_if_failed()
    except Exception as e:  # noqa: BLE001
      rec["error_before"] = str(e).strip().splitlines()[0][:300]
    try:
      vals = sorted({float(v) for v in local(f(mk(k))).ravel()})
      d.raise_if_failed()
      rec["values"], rec["want"] = vals, sum((k + 1) * 1000.0 + 10 * r for r in range(n))
      wrong += vals != [rec["want"]]
    except Exception as e:  # noqa: BLE001
      rec["error"] = str(e).strip().splitlines()[0][:300]
      try:
        jax.effects_barrier()
      except Exception:  # noqa: BLE001
        pass
    runs.append(rec)
    print("RUN " + json.dumps(rec), flush=True)
  out["runs"], out["wrong"] = runs, wrong
  out["ok"] = wrong == 0
elif case == "retry":
  # Across processes, a program that fails before a start its peer made (issue 46): rank 0's
  # program fails in a host callback before its keyed psum while rank 1's run has started it;
  # rank 0 runs again at once with 103; rank 1 runs twice, with 1 then 2 (as
  # tests/multiprocess/worker.py's retry on CPU).  Each run's values, or its error, and seconds.
  # --timeout-s 8 (config.timeout_s).
  from jax._src import distributed as jd
  client = jd.global_state.client
  argv = lambda k, v: sys.argv[sys.argv.index(k) + 1] if k in sys.argv else v  # noqa: E731
  d.configure(timeout_s=float(argv("--timeout-s", "8")))
  fail = [rank == 0]

  def gate(v):
    if fail[0]:
      raise RuntimeError("injected failure before the start")
    return v

  def body(v):
    w = jax.pure_callback(gate, jax.ShapeDtypeStruct(v.shape, v.dtype), v)
    return d.psum(w, "x", key="retry")
  f = smap(body)
  mk = lambda val: jax.make_array_from_callback((n, 1), NamedSharding(mesh, P("x")),  # noqa: E731
                                                lambda idx: np.full((n, 1), val, np.float32)[idx])
  f.lower(mk(0.0)).compile()  # both ranks: the group's memory is exchanged at lowering
  # --warm: first a run that succeeds on both (10 + 20), so that inside command buffers the
  # failed run and the retry replay a recorded psum (no handler call).
  warm = int(argv("--warm", "0"))
  vals = ([10.0] * warm + [3.0, 103.0]) if rank == 0 else ([20.0] * warm + [1.0, 2.0])
  fail[0] = rank == 0 and warm == 0
  runs = []
  for i, val in enumerate(vals):
    fail[0] = rank == 0 and i == warm
    if i < warm:  # a warm run: both ranks in it together
      client.wait_at_barrier(f"retry/warm/{i}", 120_000)
    elif rank != 0:
      client.key_value_set(f"retry/{rank}/{i}", "1")  # about to run (and start the psum)
    elif i == warm + 1:  # the retry comes once the peer's run after the warm ones has started the psum
      client.blocking_key_value_get(f"retry/1/{warm}", 120_000)
      time.sleep(1.0)
    rec = {"input": val}
    s0 = d.stats()["cuda"]
    try:  # (a failure raised late, by this call, belongs to an earlier run)
      d.raise_if_failed()
    except Exception as e:  # noqa: BLE001
      rec["error_before"] = str(e).strip().splitlines()[0][:600]
    t0 = time.perf_counter()
    try:  # (inside a command buffer a failed collective traps the GPU's context: then every later call fails)
      rec["values"] = sorted({float(v) for v in local(f(mk(val))).ravel()})
      d.raise_if_failed()
    except Exception as e:  # noqa: BLE001
      rec["error"] = str(e).strip().splitlines()[0][:600]
      rec["injected"] = "injected failure before the start" in str(e)
      try:
        jax.effects_barrier()
      except Exception:  # noqa: BLE001
        pass
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    s1 = d.stats()["cuda"]
    # Handler calls against starts the device saw: fewer calls than starts, a start replayed
    # from a command buffer.
    rec["host_calls"], rec["started"] = s1["host_calls"] - s0["host_calls"], s1["started"] - s0["started"]
    rec["tombstones"] = s1.get("tombstones", 0) - s0.get("tombstones", 0)
    runs.append(rec)
    print("RUN " + json.dumps(rec), flush=True)
  out["runs"] = runs
  # What may be returned without an error: the warm runs (10 + 20); rank 0's retry with rank 1's
  # run after its failed one (103 + 2); rank 1's run whose peer's program failed must fail.
  # Inside command buffers (--warm) the failed run traps rank 1's context, so the retries may fail
  # too (loudly); what no run may return is any other value.
  retry_ok = (runs[warm + 1].get("values") == [105.0] if not warm else
              "error" in runs[warm + 1] or runs[warm + 1].get("values") == [105.0])
  out["ok"] = (len(runs) == 2 + warm and all(r.get("values") == [30.0] and "error" not in r for r in runs[:warm]) and
               "error" in runs[warm] and retry_ok)
  out["errors"] = d.stats()["cuda"].get("errors", [])[-4:]
  client.wait_at_barrier("retry/end", 120_000)
print("RESULT " + json.dumps(out), flush=True)
if case in ("killed", "mismatch", "retry", "chaos_retry"):  # a peer gone or a CUDA context failed: no shutdown barrier
  os._exit(0 if out["ok"] else 1)
sys.exit(0 if out["ok"] else 1)
