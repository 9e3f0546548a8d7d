"""Soak: thousands of collective instances on 8 CPU devices — random op, size,
dtype, rank-specific start and done orders, re-entry in fori_loop, two
programs in flight, a few large messages — compared with jax.lax on the same
inputs; memory, threads and file descriptors must stay flat.

test_soak_ci (2,000 instances) runs in CI; test_soak_full (10,000) is marked
slow.  Sizes: 1 B ... 4 MiB per rank in loops, and 64 MiB per rank once."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import child_env, put
from jax_dfccl import testing as T

N = 8
OPS = ["psum", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute", "pbroadcast"]
DTYPES = [np.float32, jnp.bfloat16, np.int32, np.int8, np.float16]


def _call(lib, op, v, key):
  kw = {} if lib is jax.lax else {"key": key}
  if op in ("psum", "pmax", "pmin"):
    return getattr(lib, op)(v, "x", **kw)
  if op == "all_gather":
    return lib.all_gather(v, "x", tiled=True, **kw)
  if op == "psum_scatter":
    return lib.psum_scatter(v, "x", tiled=True, **kw)
  if op == "all_to_all":
    return lib.all_to_all(v, "x", 0, 0, tiled=True, **kw)
  if op == "ppermute":
    return lib.ppermute(v, "x", [(i, (i + 3) % N) for i in range(N - 1)], **kw)
  if lib is jax.lax:  # pbroadcast: jax.lax's documented definition (no CPU lowering)
    return jax.lax.psum(jnp.where(jax.lax.axis_index("x") == 5, v, jnp.zeros_like(v)), "x")
  return dc.pbroadcast(v, "x", 5, **kw)


def _start(op, v, key):
  return getattr(dc, op + "_start")(*{
      "psum": (v, "x"), "pmax": (v, "x"), "pmin": (v, "x"), "pbroadcast": (v, "x", 5),
      "ppermute": (v, "x", [(i, (i + 3) % N) for i in range(N - 1)])}.get(op, (v, "x")),
      key=key, **({"tiled": True} if op in ("all_gather", "psum_scatter") else {}),
  ) if op != "all_to_all" else dc.all_to_all_start(v, "x", 0, 0, tiled=True, key=key)


def _program(mesh, spec, iters, tag, rng):
  """One jitted program: len(spec) collectives per iteration of a fori_loop, each rank
  starting them in its own order (lax.switch on the rank) and waiting in another."""
  k = len(spec)
  orders = [rng.permutation(k) for _ in range(N)]
  done_orders = [rng.permutation(k) for _ in range(N)]

  def ours(*xs):
    def step(i, accs):
      def branch(r):
        def b(vs):
          hs = [None] * k
          for j in orders[r]:
            hs[j] = _start(spec[j][0], vs[j], f"soak/{tag}/{j}")
          outs = [None] * k
          for j in done_orders[r]:
            outs[j] = dc.done(hs[j])
          return outs
        return b
      vs = [x + i.astype(x.dtype) for x in xs]
      outs = jax.lax.switch(jax.lax.axis_index("x"), [branch(r) for r in range(N)], vs)
      return [a + o for a, o in zip(accs, outs)]
    zeros = [jnp.zeros_like(_call(jax.lax, op, x, None)) for (op, _), x in zip(spec, xs)]
    return tuple(jax.lax.fori_loop(0, iters, step, zeros))

  def ref(*xs):
    def step(i, accs):
      return [a + _call(jax.lax, op, x + i.astype(x.dtype), None) for a, (op, _), x in zip(accs, spec, xs)]
    zeros = [jnp.zeros_like(_call(jax.lax, op, x, None)) for (op, _), x in zip(spec, xs)]
    return tuple(jax.lax.fori_loop(0, iters, step, zeros))

  smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * k, out_specs=(P("x"),) * k,
                                         check_vma=False))
  return smap(ours), smap(ref)


def _inputs(mesh, spec, rng):
  xs = []
  for op, (elems, dtype) in spec:
    elems = max(N, elems // N * N)  # divisible for the scatter/exchange ops
    v = rng.integers(-2, 3, size=(N * elems,)).astype(dtype)
    xs.append(put(jnp.asarray(v), mesh, P("x")))
  return xs


def _random_spec(rng, k, max_bytes):
  spec = []
  for _ in range(k):
    op = OPS[rng.integers(len(OPS))]
    dtype = DTYPES[rng.integers(len(DTYPES))]
    if op in ("psum", "pmax", "pmin", "psum_scatter") and dtype in (np.int8,):
      dtype = np.int32
    nbytes = int(2 ** rng.uniform(0, np.log2(max_bytes)))
    spec.append((op, (max(1, nbytes // np.dtype(dtype).itemsize), dtype)))
  return spec


def _big(mesh8):
  big = put(jnp.ones((N * (16 << 20),), jnp.float32), mesh8, P("x"))  # 64 MiB per rank
  f = jax.jit(jax.shard_map(lambda v: (dc.psum(v, "x"), dc.all_to_all(v, "x", 0, 0, tiled=True)), mesh=mesh8,
                            in_specs=P("x"), out_specs=(P("x"), P("x")), check_vma=False))
  s, a = f(big)
  assert float(s[0]) == N and float(a[-1]) == 1.0
  return 2


def _soak(mesh8, instances, seed, nprogs=6, iters=10):
  """`nprogs` random programs (8 collectives x `iters` iterations each), compiled in the
  first pass, then run in pairs (two in flight) on fresh inputs until `instances`.  Memory
  is the peak RSS of each pass through the programs after the first (which compiles).  The
  live buffers differ per pair, so one pass's peak varies by several percent with no trend:
  the memory check is the trend, a robust slope (the median of the pairwise slopes, which
  one outlying pass cannot move) over the measured passes (`_rss_trend`)."""
  rng = np.random.default_rng(seed)
  progs = []
  for p in range(nprogs):
    spec = _random_spec(rng, 8, 4 << 20 if p % 3 == 0 else 64 << 10)
    progs.append((*_program(mesh8, spec, iters, f"p{p}", rng), spec))
  per_pass = nprogs // 2
  done, rss, warm = 0, [], None
  round_ = 0
  while done < instances or round_ % per_pass or round_ < 6 * per_pass:
    pair = [progs[(2 * round_) % nprogs], progs[(2 * round_ + 1) % nprogs]]
    ins = [_inputs(mesh8, spec, rng) for _, _, spec in pair]
    outs = [ours(*xs) for (ours, _, _), xs in zip(pair, ins)]  # both dispatched before either is read
    for (_, ref, spec), xs, got in zip(pair, ins, outs):
      want = ref(*xs)
      for (op, (_, dtype)), a, b in zip(spec, got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{op} {np.dtype(dtype)}")
      done += 8 * iters
    del ins, outs, got, want
    if round_ in (per_pass - 1, 3 * per_pass - 1):  # the large messages, in the warm-up and in the measured passes
      done += _big(mesh8)
    rss.append(T.rss_kib())
    if round_ == 3 * per_pass - 1:  # end of the third pass
      warm = (None, T.open_fds(), T.os_threads())
    round_ += 1
  done += _big(mesh8)
  rss[-1] = max(rss[-1], T.rss_kib())
  assert dc.stats()["cpu"]["instances_live"] == 0
  peaks = [max(rss[i:i + per_pass]) for i in range(0, len(rss), per_pass)][1:]  # one per pass, after the first
  growth, level = _rss_trend(peaks)
  end = (T.open_fds(), T.os_threads())
  print(f"\nsoak: {done} instances, {len(peaks) + 1} passes; peak RSS per pass after the first "
        f"{min(peaks)}-{max(peaks)} KiB (median {level:.0f}), trend over the run {100 * growth:+.1f}%, "
        f"fds {warm[1]} -> {end[0]}, OS threads {warm[2]} -> {end[1]}")
  assert end[0] <= warm[1] and end[1] <= warm[2], (warm, end)
  return peaks, growth


def _rss_trend(peaks):
  """(growth, level) of a series of per-pass peaks: the Theil-Sen slope (the median of the
  slopes between every two passes) times the passes spanned, as a fraction of the median
  peak.  A leak grows every pass and shows in it; one pass's spike (a pair of programs whose
  live buffers peak together) moves the median of the slopes little, unlike a comparison of
  maxima."""
  slopes = [(peaks[j] - peaks[i]) / (j - i) for i in range(len(peaks)) for j in range(i + 1, len(peaks))]
  level = float(np.median(peaks))
  return float(np.median(slopes)) * (len(peaks) - 1) / level, level


def test_rss_trend_flags_a_leak_not_a_spike():
  flat = [1_080_000, 1_150_000, 1_100_000, 1_210_000, 1_090_000, 1_120_000, 1_100_000, 1_160_000]
  assert abs(_rss_trend(flat)[0]) < 0.05
  spike = flat[:-1] + [1_300_000]  # the last pass 18% above the rest: noise, not a trend
  assert _rss_trend(spike)[0] < 0.05
  leak = [p + 12_000 * i for i, p in enumerate(flat)]  # 1% of the level per pass
  assert _rss_trend(leak)[0] > 0.05


def _check_memory(peaks, growth):
  # Under 5% growth over the run, and no pass in the second half 15% above the first half's peak.
  half = len(peaks) // 2
  assert growth < 0.05, (growth, peaks)
  assert max(peaks[half:]) < 1.15 * max(peaks[:half]), peaks


def test_soak_ci(mesh8):
  _check_memory(*_soak(mesh8, 2000, seed=0))


@pytest.mark.slow
def test_soak_full(mesh8):
  _check_memory(*_soak(mesh8, 10000, seed=1))


def test_gpu_soak_worker_on_cpu(tmp_path):
  """The GPU soak's worker (tests/gpu/soak_worker.py) on 4 CPU devices: its numpy
  reference and its memory accounting, checked where CI runs."""
  import json
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  p = subprocess.run([sys.executable, str(root / "tests/gpu/soak_worker.py"), "--instances", "200"],
                     capture_output=True, text=True, timeout=300, env=child_env(4), cwd=tmp_path)
  line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
  assert line, (p.stdout[-2000:], p.stderr[-3000:])
  r = json.loads(line[-1][7:])
  assert p.returncode == 0 and r["ok"] and r["backend"] == "cpu" and r["ranks"] == 4, r
  assert r["instances"] >= 200 and r["runtime_started"] >= 4 * r["instances"], r
  assert r["runtime_threads"][0] >= 1 and r["threads_new"] == {}, r  # the runtime's threads carry its names
