"""The soak on GPUs: thousands of collective instances — random op, size (1 B ...
4 MiB per rank, and 64 MiB once per pass), dtype, process-specific start and
done orders, re-entry in a fori_loop, two programs in flight — each result
compared exactly with numpy on the same inputs (small integers: every dtype sums
them exactly), host and device memory, threads and file descriptors flat.

One process over one GPU (a group of one forced through the runtime):
    python tests/gpu/soak_worker.py --instances 10000
Several processes on one GPU under MPS (one rank each), the runtime across processes:
    tools/mps_testbed.sh -n 2 -- python tests/gpu/soak_worker.py --instances 10000
It also runs on CPU devices (one process: every local device is a rank), which is
how its reference is checked without a GPU.  Prints one JSON line ``RESULT {...}``;
exits non-zero on a wrong result or growth."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.2")
# Programs differ per process: XLA's autotuning shared across processes (by module
# fingerprint) would wait for modules the other processes never compile.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false"

import jax  # noqa: E402

MULTI = "DFCCL_TESTBED_RANK" in os.environ
if MULTI:
  jax.distributed.initialize(os.environ["DFCCL_TESTBED_COORD"], int(os.environ["DFCCL_TESTBED_NPROC"]),
                             int(os.environ["DFCCL_TESTBED_RANK"]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_dfccl as d  # noqa: E402
from jax_dfccl import testing as T  # noqa: E402

OPS = ["psum", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute", "pbroadcast"]
DTYPES = [np.float32, jnp.bfloat16, np.int32, np.int8, np.float16]
PER_PROGRAM = 8


class Soak:
  def __init__(self, seed: int, iters: int):
    d.initialize()
    self.devs = jax.devices()
    self.n = len(self.devs)
    self.mesh = Mesh(np.array(self.devs), ("x",))
    self.rank = jax.process_index()
    self.backend = "cuda" if self.devs[0].platform == "gpu" else "cpu"
    if self.n == 1:
      d.configure(runtime_for_groups_of_one=True)  # else nothing reaches the runtime
    self.iters = iters
    self.root = self.n - 1
    self.perm = [(i, (i + 1) % self.n) for i in range(self.n - 1)]  # partial: rank 0 receives nothing
    self.rng = np.random.default_rng(seed)

  # ---- the collectives and their numpy references --------------------------------
  def _call(self, op, v, key):
    if op in ("psum", "pmax", "pmin"):
      return getattr(d, op + "_start")(v, "x", key=key)
    if op == "pbroadcast":
      return d.pbroadcast_start(v, "x", self.root, key=key)
    if op == "ppermute":
      return d.ppermute_start(v, "x", self.perm, key=key)
    if op == "all_to_all":
      return d.all_to_all_start(v, "x", 0, 0, tiled=True, key=key)
    return getattr(d, op + "_start")(v, "x", tiled=True, key=key)

  def _reference(self, op, shards):
    """The global output (ranks' outputs concatenated) from the ranks' inputs (int64)."""
    n = self.n
    if op in ("psum", "pmax", "pmin"):
      red = {"psum": np.sum, "pmax": np.max, "pmin": np.min}[op](shards, axis=0)
      return np.concatenate([red] * n)
    if op == "pbroadcast":
      return np.concatenate([shards[self.root]] * n)
    if op == "ppermute":
      src = {dst: s for s, dst in self.perm}
      return np.concatenate([shards[src[r]] if r in src else np.zeros_like(shards[0]) for r in range(n)])
    if op == "all_gather":
      return np.concatenate([np.concatenate(shards)] * n)
    if op == "psum_scatter":
      return np.sum(shards, axis=0)  # rank r's block is block r of the sum: the global array is the sum
    return np.concatenate([np.concatenate([shards[s].reshape(n, -1)[r] for s in range(n)]) for r in range(n)])

  def out_elems(self, op, elems):  # one rank's output length
    return elems * self.n if op == "all_gather" else elems // self.n if op == "psum_scatter" else elems

  # ---- programs --------------------------------------------------------------------
  def random_spec(self, max_bytes):
    spec = []
    for _ in range(PER_PROGRAM):
      op = OPS[self.rng.integers(len(OPS))]
      dtype = DTYPES[self.rng.integers(len(DTYPES))]
      nbytes = int(2 ** self.rng.uniform(0, np.log2(max_bytes)))
      elems = max(self.n, max(1, nbytes // np.dtype(dtype).itemsize) // self.n * self.n)
      spec.append((op, elems, dtype))
    return spec

  def program(self, spec, tag):
    """`iters` iterations of the spec's collectives, started in this process's
    order and waited for in another; each output accumulated over the iterations."""
    k = len(spec)
    orders = [self.rng.permutation(k) for _ in range(jax.process_count())]
    done_orders = [self.rng.permutation(k) for _ in range(jax.process_count())]
    order, done_order = orders[self.rank], done_orders[self.rank]

    def body(*xs):
      def step(i, accs):
        vs = [x + i.astype(x.dtype) for x in xs]
        hs = [None] * k
        for j in order:
          hs[j] = self._call(spec[j][0], vs[j], f"soak/{tag}/{j}")
        outs = [None] * k
        for j in done_order:
          outs[j] = d.done(hs[j])
        return [a + o for a, o in zip(accs, outs)]
      zeros = [jnp.zeros((self.out_elems(op, x.shape[0]),), x.dtype) for (op, _, _), x in zip(spec, xs)]
      return tuple(jax.lax.fori_loop(0, self.iters, step, zeros))

    specs = (P("x"),) * k
    return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=specs, check_vma=False))

  def inputs(self, spec):
    xs, shards = [], []
    for _, elems, dtype in spec:
      full = self.rng.integers(-2, 3, size=(self.n * elems,))
      xs.append(jax.make_array_from_callback(full.shape, NamedSharding(self.mesh, P("x")),
                                             lambda idx, full=full, dtype=dtype: full[idx].astype(dtype)))
      shards.append(full.reshape(self.n, elems))
    return xs, shards

  def expected(self, spec, shards):
    outs = []
    for (op, _, dtype), sh in zip(spec, shards):
      acc = sum(self._reference(op, sh + i) for i in range(self.iters))
      outs.append(acc.astype(dtype))
    return outs

  def check(self, got, want, what):
    for shard in got.addressable_shards:
      a = np.asarray(shard.data).astype(np.float64)
      b = want[shard.index].astype(np.float64)
      if a.shape != b.shape or not np.array_equal(a, b):
        bad = int(np.sum(a != b)) if a.shape == b.shape else -1
        raise AssertionError(f"{what}: {bad} elements differ from numpy on device {shard.device}")

  def big(self):
    """A 64 MiB-per-rank psum and all_to_all (the large-message paths; one program, compiled once)."""
    elems = 16 << 20
    x = jax.make_array_from_callback((self.n * elems,), NamedSharding(self.mesh, P("x")),
                                     lambda idx: np.ones(len(range(*idx[0].indices(self.n * elems))), np.float32))
    if not hasattr(self, "_big"):
      self._big = jax.jit(jax.shard_map(lambda v: (d.psum(v, "x", key="soak/big/psum"),
                                                   d.all_to_all(v, "x", 0, 0, tiled=True, key="soak/big/a2a")),
                                        mesh=self.mesh, in_specs=P("x"), out_specs=(P("x"), P("x")), check_vma=False))
    s, a = self._big(x)
    self.check(s, np.full(self.n * elems, self.n, np.float32), "64 MiB psum")
    self.check(a, np.ones(self.n * elems, np.float32), "64 MiB all_to_all")
    return 2


def device_bytes():
  dev = jax.local_devices()[0]
  st = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  return int(st.get("bytes_in_use", 0)) if st else 0


def held(st):  # what the runtime holds: device bytes (GPU), live instances (CPU)
  return int(st["bytes_held"] if "bytes_held" in st else st["instances_live"])


def watch(rounds, period):
  """A thread that prints what the runtimes hold in flight (jax_dfccl.pending()) once no
  round has completed for `period` seconds: a stalled soak says where it stands."""
  import threading

  def run():
    last, since = rounds[0], time.monotonic()
    while True:
      time.sleep(min(period, 1.0))
      if rounds[0] != last:
        last, since = rounds[0], time.monotonic()
      elif time.monotonic() - since > period:
        print(f"STALLED at round {last} for {period} s; PENDING\n{d.pending()}", flush=True)
        return
  threading.Thread(target=run, daemon=True).start()


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--instances", type=int, default=2000)
  ap.add_argument("--programs", type=int, default=6)
  ap.add_argument("--iters", type=int, default=3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--growth", type=float, default=0.05, help="allowed growth of peak RSS after warm-up")
  ap.add_argument("--config", default="", help="jax_dfccl.config entries, k=v,... (e.g. small_slots=2)")
  ap.add_argument("--watch", type=float, default=0,
                  help="seconds without a round completed after which jax_dfccl.pending() is printed (once)")
  args = ap.parse_args()
  if args.config:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from benchmarks.common import parse_config
    d.configure(**parse_config(args.config))
  s = Soak(args.seed, args.iters)
  t_start = time.perf_counter()
  progs = []
  for p in range(args.programs):
    spec = s.random_spec(4 << 20 if p % 3 == 0 else 64 << 10)
    progs.append((s.program(spec, f"p{p}"), spec))
  started0 = d.stats()[s.backend]["started"]
  per_pass = max(1, args.programs // 2)  # rounds per pass through the programs (two per round)
  done, rss, dev_mem, threads, warm, round_ = 0, [], [], [], None, 0
  rounds = [0]  # rounds completed, for the watcher
  if args.watch > 0:
    watch(rounds, args.watch)
  result = {"rank": s.rank, "ranks": s.n, "backend": s.backend, "ok": True}
  try:
    while done < args.instances or round_ % per_pass or round_ < 6 * per_pass:
      pair = [progs[(2 * round_) % len(progs)], progs[(2 * round_ + 1) % len(progs)]]
      ins = [s.inputs(spec) for _, spec in pair]
      outs = [f(*xs) for (f, _), (xs, _) in zip(pair, ins)]  # both dispatched before either is read
      for (_, spec), (_, shards), got in zip(pair, ins, outs):
        for (op, elems, dtype), g, w in zip(spec, got, s.expected(spec, shards)):
          s.check(g, w, f"{op} x {elems} {np.dtype(dtype).name} (round {round_})")
        done += PER_PROGRAM * args.iters
      del ins, outs
      if round_ % per_pass == per_pass - 1 and round_ // per_pass in (0, 2):  # the warm-up and a measured pass
        done += s.big()
      rss.append(T.rss_kib())
      dev_mem.append(device_bytes())
      threads.append(T.os_threads())
      if round_ == 3 * per_pass - 1:
        warm = (T.open_fds(), T.os_threads(), held(d.stats()[s.backend]), T.thread_names())
      round_ += 1
      rounds[0] = round_
  except AssertionError as e:
    result["ok"], result["error"] = False, str(e)[:500]
  st = d.stats()[s.backend]
  rss, dev_mem = rss or [T.rss_kib()], dev_mem or [device_bytes()]
  peaks = [max(rss[i:i + per_pass]) for i in range(0, len(rss), per_pass)]
  dpeaks = [max(dev_mem[i:i + per_pass]) for i in range(0, len(dev_mem), per_pass)]
  mid = max(3, len(peaks) // 2)
  w_rss, e_rss = max(peaks[1:mid] or peaks), max(peaks[-2:])
  w_dev, e_dev = max(dpeaks[1:mid] or dpeaks), max(dpeaks[-2:])
  result.update(
      instances=done, runtime_started=int(st["started"] - started0), passes=len(peaks),
      seconds=round(time.perf_counter() - t_start, 1),
      rss_kib=[w_rss, e_rss], rss_growth=(e_rss - w_rss) / w_rss,
      device_bytes=[w_dev, e_dev], device_growth=(e_dev - w_dev) / max(w_dev, 1),
      fds=[warm[0] if warm else None, T.open_fds()], threads=[warm[1] if warm else None, T.os_threads()],
      threads_per_pass=[max(threads[i:i + per_pass]) for i in range(0, len(threads), per_pass)],
      runtime_held=[warm[2] if warm else None, held(st)],
      pending=int(st["pending"]), failed=int(st["failed"]))
  names = T.thread_names()
  if warm:
    result["runtime_threads"] = [T.runtime_threads(warm[3]), T.runtime_threads(names)]
    result["threads_new"] = dict(names - warm[3])  # by name: XLA's and the runtimes'
  # Threads: the runtimes' (named dfccl-...) must not grow; XLA's pools may start
  # threads lazily (reported in threads_new).  Device memory: XLA's in use is a few
  # MiB here, so growth is allowed max(growth, 1 MiB).
  grew = (result["rss_growth"] >= args.growth or e_dev - w_dev > max(args.growth * w_dev, 1 << 20)
          or (warm and (T.open_fds() > warm[0] or T.runtime_threads(names) > T.runtime_threads(warm[3]) or held(st) > warm[2])))
  # Every instance reached the runtime (a group of one is forced through it).
  result["ok"] &= not grew and result["runtime_started"] >= done and result["pending"] == 0
  print("RESULT " + json.dumps(result), flush=True)
  return 0 if result["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
