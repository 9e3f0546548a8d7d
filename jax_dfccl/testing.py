"""The chaos-order workload, shared by the tests, the demo, the benchmarks and
the notebooks; and the soaks' process accounting (memory, threads by name, fds).

Eight collectives of different kinds and sizes.  In the chaos program every
rank starts them in its own order (``START[r]``) and waits for them in another
(``DONE[r]``), chosen so that at every position every rank has a different
collective; rank-specific code is selected with ``lax.switch(axis_index)``.
With jax_dfccl (start/done forms, keyed) it completes with exact results; the
same program with blocking jax.lax collectives deadlocks on GPUs (NCCL matches
collectives by issue order).
"""
from __future__ import annotations

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_dfccl as dc

NUM = 8


def gpus() -> list:
  """The GPU devices JAX sees ([] without a GPU backend); for skipping GPU tests."""
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def collectives(axis: str, n: int):
  """[(name, local length, start(x, key) -> handle, jax.lax reference(x))]."""
  ring = [(i, (i + 1) % n) for i in range(n)]
  return [
      ("psum_small", 4, lambda x, k: dc.psum_start(x, axis, key=k), lambda x: jax.lax.psum(x, axis)),
      ("all_gather", 16, lambda x, k: dc.all_gather_start(x, axis, tiled=True, key=k),
       lambda x: jax.lax.all_gather(x, axis, tiled=True)),
      ("psum_scatter", 8 * n, lambda x, k: dc.psum_scatter_start(x, axis, tiled=True, key=k),
       lambda x: jax.lax.psum_scatter(x, axis, tiled=True)),
      ("all_to_all", 16 * n, lambda x, k: dc.all_to_all_start(x, axis, 0, 0, tiled=True, key=k),
       lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)),
      ("ppermute", 32, lambda x, k: dc.ppermute_start(x, axis, ring, key=k),
       lambda x: jax.lax.ppermute(x, axis, ring)),
      ("pmax", 256, lambda x, k: dc.pmax_start(x, axis, key=k), lambda x: jax.lax.pmax(x, axis)),
      ("psum_mid", 1024, lambda x, k: dc.psum_start(x, axis, key=k), lambda x: jax.lax.psum(x, axis)),
      ("psum_big", 16384, lambda x, k: dc.psum_start(x, axis, key=k), lambda x: jax.lax.psum(x, axis)),
  ]


def start_order(r: int) -> list[int]:
  return [(j + r) % NUM for j in range(NUM)]


def done_order(r: int) -> list[int]:
  return [(3 * j + 5 * r + 1) % NUM for j in range(NUM)]


def chaos_inputs(mesh, axis: str, scale: int = 1, seed: int = 0):
  n = mesh.shape[axis]
  rng = np.random.default_rng(seed)
  return [jax.device_put(jnp.asarray(rng.integers(-3, 4, size=(n * L * scale,)), jnp.float32),
                         NamedSharding(mesh, P(axis)))
          for _, L, _, _ in collectives(axis, n)]


def _program(mesh, axis, iters, step_outs):
  n = mesh.shape[axis]
  colls = collectives(axis, n)

  def body(*xs):
    def step(it, acc):
      inp = [x + it.astype(x.dtype) for x in xs]
      return [a + o for a, o in zip(acc, step_outs(inp, colls, n))]
    init = [jnp.zeros_like(ref(x)) for x, (_, _, _, ref) in zip(xs, colls)]
    return jax.lax.fori_loop(0, iters, step, init)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                               check_vma=False))


def chaos_program(mesh, axis: str, iters: int, lib: str = "dfccl"):
  """Rank-specific issue orders.  lib='dfccl': start/done forms with keys, waits in
  yet another order.  lib='lax': blocking jax.lax collectives in the start order."""

  def outs(inp, colls, n):
    def branch(r):
      def run(inp):
        res = [None] * NUM
        if lib == "lax":
          for i in start_order(r):
            res[i] = colls[i][3](inp[i])
          return res
        hs = [None] * NUM
        for i in start_order(r):
          hs[i] = colls[i][2](inp[i], f"chaos/{colls[i][0]}")
        for i in done_order(r):
          res[i] = dc.done(hs[i])
        return res
      return run
    return jax.lax.switch(jax.lax.axis_index(axis), [branch(r) for r in range(n)], inp)
  return _program(mesh, axis, iters, outs)


def reference_program(mesh, axis: str, iters: int):
  """The same collectives, blocking jax.lax, the same order on every rank."""
  return _program(mesh, axis, iters,
                  lambda inp, colls, n: [ref(x) for x, (_, _, _, ref) in zip(inp, colls)])


def ordered_program(mesh, axis: str, iters: int):
  """jax_dfccl blocking forms in the same order on every rank (SPMD style)."""
  return _program(mesh, axis, iters, lambda inp, colls, n: [
      dc.done(st(x, None)) for x, (_, _, st, _) in zip(inp, colls)])


def alternating_chaos(axis: str, n: int, elems: int, seed: int = 0):
  """A second, size-parameterised chaos workload for per-shard code: 8 collectives
  alternating psum and tiled all_gather (of ``y * (i + 1)``, the gathers cut to
  ``elems``), started in a random order per rank, then all done; returns their sum.
  ``alternating_reference`` is the same in one consistent order with jax.lax."""
  rng = np.random.default_rng(seed)
  orders = [list(rng.permutation(NUM)) for _ in range(n)]

  def branch(order):
    def run(y):
      hs = {}
      for i in order:
        hs[i] = (dc.psum_start(y * (i + 1), axis, key=f"alt{i}") if i % 2 == 0
                 else dc.all_gather_start(y * (i + 1), axis, tiled=True, key=f"alt{i}"))
      return sum(dc.done(hs[i])[:elems] for i in range(NUM))
    return run

  return lambda y: jax.lax.switch(jax.lax.axis_index(axis), [branch(o) for o in orders], y)


def alternating_reference(axis: str, elems: int):
  def body(y):
    return sum(jax.lax.psum(y * (i + 1), axis) if i % 2 == 0
               else jax.lax.all_gather(y * (i + 1), axis, tiled=True)[:elems] for i in range(NUM))
  return body


# ---- process accounting (the soaks) ----------------------------------------------
def _status_field(name: str) -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith(name + ":"))


def rss_kib() -> int:
  """This process's resident memory (KiB)."""
  return _status_field("VmRSS")


def os_threads() -> int:
  """This process's OS threads."""
  return _status_field("Threads")


def open_fds() -> int:
  """This process's open file descriptors."""
  return len(os.listdir("/proc/self/fd"))


def thread_names() -> collections.Counter:
  """This process's threads by name: the runtimes name theirs "dfccl-..."
  (XLA's pools start threads lazily, unnamed)."""
  names = collections.Counter()
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/comm") as f:
        names[f.read().strip()] += 1
    except OSError:  # exited meanwhile
      pass
  return names


def runtime_threads(names: collections.Counter) -> int:
  """How many of `names` (thread_names()) are the runtimes' threads."""
  return sum(c for n, c in names.items() if n.startswith("dfccl"))
