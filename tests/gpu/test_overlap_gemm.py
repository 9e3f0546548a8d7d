"""GPU tests of the fused overlap GEMM alone, on one GPU (`pytest -m gpu tests/gpu/test_overlap_gemm.py`).

The fused kernels of xla_ffi/overlap/ run here over a one-device axis (a group
of one rank: no peers, so no pushes, waits or remote stores), which leaves the
GEMM itself -- tile scheduler, TMA loads with zero fill, the 1x1 and 2x1
cluster variants, predicated epilogues -- checked against a float32 jnp.dot of
the same rounded inputs, on shapes whose M, N, K are not multiples of the
128-row tiles of any width (128, 192, 256) and whose m-tile counts are odd (the second tile of the last
2x1 pair lies below the matrix), and the split of a partial last wave
(xla_ffi/overlap/plan.cc, Schedule; on 132 SMs): one partial wave split
into 4 chunks (600x1040x1000: 25 tiles of 16 k iterations, 100 units) or 2
(1024x2048x1024: 64 tiles, 128 units), whole tiles then a last wave of 33
tiles in 2 chunks of 5-6 iterations (1300x3600x704: 165 tiles, 198 units) or
of 2 tiles in 4 chunks (200x17000x1000: 134 tiles, 140 units), and shapes
where it is not chosen (K = 8: one k iteration; 2, 9 or 18 tiles of few
iterations).  Needs one sm90 GPU; the cross-rank paths
are tested in test_overlap_gpu.py (two GPUs).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jax_dfccl.testing import gpus  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(len(gpus()) < 1, reason="needs a GPU")]

TOL = {jnp.bfloat16: 2.5e-2, jnp.float16: 4e-3}
# (M, N, K): 1, 3, 5 and 9 m tiles; N and K odd multiples of 8; K < 64; one exact tile multiple
SHAPES = [(96, 272, 136), (328, 528, 200), (600, 1040, 1000), (1100, 264, 8), (1024, 2048, 1024)]


def _og():
  from jax_dfccl._src import overlap_gpu as og
  if not og.available():
    pytest.skip("fused overlap ops not available (need sm90 GPUs and _dfccl_cuda built with CUTLASS)")
  return og


def _inputs(M, N, K, dtype, seed):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (M, K), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (K, N), jnp.float32) / K ** 0.5).astype(dtype)
  return x, w


def _close(got, ref, dtype, what):
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  assert got.shape == ref.shape, (what, got.shape, ref.shape)
  err = np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-6)
  assert np.isfinite(got).all() and err < TOL[dtype], f"{what}: max rel error {err:.3g}"


def _run(kind, cluster_m, x, w, split=True, tile_n=0, raster=0, tma_store=False, pingpong=False):
  """The fused op traced under overlap_cluster_m / overlap_split_last_wave / overlap_tile_n / overlap_raster /
  overlap_tma_store / overlap_pingpong (read at trace time)."""
  og = _og()
  import jax_dfccl
  mesh = Mesh(np.array(gpus()[:1]), ("one",))
  if kind == "ag":
    body = lambda x, w: og.all_gather_matmul(x, w, "one", 1)[0]  # noqa: E731
  else:
    body = lambda x, w: og.matmul_reduce_scatter(x, w, "one", 1)  # noqa: E731
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
  with jax_dfccl.configured(overlap_cluster_m=cluster_m, overlap_split_last_wave=split, overlap_tile_n=tile_n,
                            overlap_raster=raster, overlap_tma_store=tma_store, overlap_pingpong=pingpong):
    lowered = f.lower(x, w)
  text, compiled = lowered.as_text(), lowered.compile()
  assert f"dfccl_overlap_{kind}" in text, "fused kernel not used"
  mode = int(re.search(r"mode = (\d+)", text).group(1))
  assert bool(mode & og.MODE_CLUSTER_M2) == (cluster_m == 2), mode
  assert bool(mode & og.MODE_NO_SPLIT) == (not split), mode
  assert (mode >> og.MODE_TILE_SHIFT) & 3 == (og.TILE_NS.index(tile_n) + 1 if tile_n else 0), mode
  assert (mode >> og.MODE_RASTER_SHIFT) & 7 == raster, mode
  tma_bits = og.MODE_TMA_STORE_AUTO if tma_store is None else og.MODE_TMA_STORE if tma_store else 0
  assert mode & (og.MODE_TMA_STORE | og.MODE_TMA_STORE_AUTO) == tma_bits, mode
  assert bool(mode & og.MODE_PINGPONG) == pingpong, mode
  return compiled


# Every tile width with bf16; f16 with the widths whose epilogue differs (a 64-column last piece; whole pieces).
DTYPE_TILES = [(jnp.bfloat16, 128), (jnp.bfloat16, 192), (jnp.bfloat16, 256), (jnp.float16, 192),
               (jnp.float16, 256)]


@pytest.mark.parametrize("dtype,tile_n", DTYPE_TILES, ids=[f"{'bf16' if d == jnp.bfloat16 else 'f16'}-t{t}"
                                                          for d, t in DTYPE_TILES])
@pytest.mark.parametrize("cluster_m", [1, 2], ids=["1x1", "2x1"])
@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_one_rank_gemm(M, N, K, kind, cluster_m, dtype, tile_n):
  x, w = _inputs(M, N, K, dtype, seed=M + N + K)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  g = _run(kind, cluster_m, x, w, tile_n=tile_n)
  for it in range(3):  # repeated instances on one channel (tile counter base, flags by instance)
    _close(g(x, w), ref, dtype, f"{kind} {M}x{N}x{K} cluster {cluster_m} tile_n {tile_n} iter {it}")
  _og().check()


def test_tile_widths_alternate_on_one_channel():
  """Launches of one op with different tile widths (and so tile grids) share a channel: RS flags and the
  split's partials are indexed per tile of the launch's own grid; alternating them stays exact."""
  x, w = _inputs(600, 1040, 1000, jnp.bfloat16, seed=9)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  gs = [_run("rs", 1, x, w, tile_n=t) for t in (0, 128, 192, 256)]
  for it in range(8):
    _close(gs[it % 4](x, w), ref, jnp.bfloat16, f"alternating widths iter {it}")
  _og().check()


@pytest.mark.parametrize("raster", range(1, 7))
@pytest.mark.parametrize("cluster_m", [1, 2], ids=["1x1", "2x1"])
@pytest.mark.parametrize("kind", ["ag", "rs"])
def test_tile_orders(kind, cluster_m, raster):
  """Every forced tile order (config.overlap.raster, protocol.h kRasters) covers every tile once: 9 m tiles
  (an odd count: the last 2x1 pair half below the matrix) x 7 n tiles of 128 (groups of 2, 4 and 8 columns
  with a narrower last one), and the split last wave (1x1)."""
  M, N, K = 1100, 840, 1000
  x, w = _inputs(M, N, K, jnp.bfloat16, seed=raster)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  g = _run(kind, cluster_m, x, w, tile_n=128, raster=raster)
  for it in range(2):
    _close(g(x, w), ref, jnp.bfloat16, f"{kind} cluster {cluster_m} raster {raster} iter {it}")
  _og().check()


@pytest.mark.parametrize("dtype,tile_n", DTYPE_TILES, ids=[f"{'bf16' if d == jnp.bfloat16 else 'f16'}-t{t}"
                                                          for d, t in DTYPE_TILES])
@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("M,N,K", SHAPES + [(1300, 3600, 704)])
def test_tma_store(M, N, K, kind, dtype, tile_n):
  """config.overlap.tma_store: the epilogue's bulk tensor stores (a group of one: every tile's destination is the
  output) -- partial tiles clipped at M and N (odd multiples of 8), K = 8, a split last wave (1300x3600x704 at
  128 columns), every width and both types -- exact against the same reference as the threads' stores; repeated
  instances reuse the staging tile while earlier stores may still read it."""
  x, w = _inputs(M, N, K, dtype, seed=3 * M + N + K)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  g = _run(kind, 1, x, w, tile_n=tile_n, tma_store=True)
  for it in range(3):
    _close(g(x, w), ref, dtype, f"{kind} {M}x{N}x{K} tile_n {tile_n} tma iter {it}")
  _og().check()


@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("M,N,K", [(2048, 4096, 512), (1300, 3600, 704), (2000, 4000, 4096)])
def test_tma_store_auto(M, N, K, kind):
  """overlap_tma_store=None (the default): on shapes of more than one wave with K <= 4096 the plan picks the bulk
  stores (checked on the plan the handler makes from the same mode bits and SM count), and the result is exact."""
  og = _og()
  import jax_dfccl
  x, w = _inputs(M, N, K, jnp.bfloat16, seed=M + 7 * K)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  g = _run(kind, 1, x, w, tma_store=None)
  sms = getattr(gpus()[0], "core_count", None) or 132
  with jax_dfccl.configured(overlap_cluster_m=1, overlap_tma_store=None):
    plan = og.module().plan(1, M, N, K, sms, sms, og._mode(og._config(), kind, 1, 0), kind)
  assert plan["tma_store"] == 1 and plan["tiles"] > sms, plan
  for it in range(3):
    _close(g(x, w), ref, jnp.bfloat16, f"{kind} {M}x{N}x{K} tma auto iter {it}")
  og.check()


def test_tma_store_and_thread_stores_alternate():
  """Launches with and without bulk tensor stores share a channel (and the output buffers XLA reuses)."""
  x, w = _inputs(600, 1040, 1000, jnp.bfloat16, seed=11)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  gs = [_run("ag", 1, x, w, tma_store=t) for t in (False, True)]
  for it in range(6):
    _close(gs[it % 2](x, w), ref, jnp.bfloat16, f"alternating tma iter {it}")
  _og().check()


PINGPONG_CASES = [(jnp.bfloat16, False), (jnp.bfloat16, True), (jnp.float16, True)]


@pytest.mark.parametrize("dtype,tma", PINGPONG_CASES, ids=[f"{'bf16' if d == jnp.bfloat16 else 'f16'}-"
                                                          f"{'tma' if t else 'threads'}" for d, t in PINGPONG_CASES])
@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("M,N,K", SHAPES + [(1300, 3600, 704), (200, 17000, 1000), (2048, 4096, 512)])
def test_pingpong(M, N, K, kind, dtype, tma):
  """config.overlap.pingpong: the two consumer warp groups compute a unit each, in turns -- partial tiles at M and
  N, K = 8, fewer units than CTAs (a group with no unit), a split last wave (1300x3600x704, 200x17000x1000: the
  owner's and the partials' units in either group), several waves (2048x4096x512: 512 units on 132 CTAs), the
  threads' and the bulk stores -- exact against the same reference, on repeated instances.  The plan says
  ping-pong."""
  og = _og()
  x, w = _inputs(M, N, K, dtype, seed=5 * M + N + K)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  g = _run(kind, 1, x, w, tma_store=tma, pingpong=True)
  sms = getattr(gpus()[0], "core_count", None) or 132
  plan = og.module().plan(1, M, N, K, sms, sms, og.MODE_PINGPONG | (og.MODE_TMA_STORE if tma else 0), kind)
  assert plan["pingpong"] == 1 and plan["tile_n"] == 128 and plan["tma_store"] == int(tma), plan
  for it in range(3):
    _close(g(x, w), ref, dtype, f"{kind} {M}x{N}x{K} pingpong tma={tma} iter {it}")
  og.check()


def test_pingpong_and_cooperative_alternate():
  """Ping-pong and cooperative launches (and bulk vs thread stores, split vs whole tiles) of one op share a channel
  (one tile counter, the split's partials and flags): alternating them stays exact."""
  x, w = _inputs(1300, 3600, 704, jnp.bfloat16, seed=21)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  gs = [_run("ag", 1, x, w, pingpong=True), _run("ag", 1, x, w, tile_n=128), _run("ag", 1, x, w, pingpong=True,
        tma_store=True), _run("ag", 1, x, w, pingpong=True, split=False), _run("ag", 2, x, w)]
  for it in range(10):
    _close(gs[it % 5](x, w), ref, jnp.bfloat16, f"alternating ping-pong iter {it}")
  _og().check()


def test_variants_alternate_on_one_channel():
  """1x1 and 2x1 launches of the same op share a channel (one tile counter): alternating them stays exact."""
  x, w = _inputs(600, 1040, 1000, jnp.bfloat16, seed=5)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  g1, g2 = _run("rs", 1, x, w), _run("rs", 2, x, w)
  for it in range(6):
    _close((g2 if it % 2 else g1)(x, w), ref, jnp.bfloat16, f"alternating iter {it}")
  _og().check()


@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("M,N,K", [(1300, 3600, 704), (1100, 5000, 200)])
def test_auto_cluster(M, N, K, kind):
  """overlap_cluster_m = 0: the host picks 1x1 + split (first shape, 132 SMs) or 2x1 (180 tiles, 9 m tiles)."""
  x, w = _inputs(M, N, K, jnp.bfloat16, seed=M + 2 * N + K)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  g = _run(kind, 0, x, w)
  for it in range(3):
    _close(g(x, w), ref, jnp.bfloat16, f"{kind} {M}x{N}x{K} auto cluster iter {it}")
  _og().check()


# Split last wave on 132 SMs: whole tiles + 33 tiles in 2 chunks; + 2 tiles in 4 chunks; 25 tiles in 4 chunks
SPLIT_SHAPES = [(1300, 3600, 704), (200, 17000, 1000), (600, 1040, 1000)]


@pytest.mark.parametrize("dtype,tile_n", DTYPE_TILES, ids=[f"{'bf16' if d == jnp.bfloat16 else 'f16'}-t{t}"
                                                          for d, t in DTYPE_TILES])
@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("M,N,K", SPLIT_SHAPES)
def test_split_last_wave_against_whole_tiles(M, N, K, kind, dtype, tile_n):
  """Split allowed and not: both match the f32 reference, on repeated instances (flags by instance)."""
  x, w = _inputs(M, N, K, dtype, seed=3 * M + N + K)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  g_sk, g_dp = _run(kind, 1, x, w, split=True, tile_n=tile_n), _run(kind, 1, x, w, split=False, tile_n=tile_n)
  for it in range(3):
    _close(g_sk(x, w), ref, dtype, f"{kind} {M}x{N}x{K} split iter {it}")
    _close(g_dp(x, w), ref, dtype, f"{kind} {M}x{N}x{K} whole tiles iter {it}")
  x2, w2 = _inputs(M, N, K, dtype, seed=M + 7)  # fresh inputs through the same programs
  _close(g_sk(x2, w2), jnp.dot(x2.astype(jnp.float32), w2.astype(jnp.float32)), dtype, f"{kind} split fresh")
  _og().check()


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "stream_order"])
@pytest.mark.parametrize("between", [False, True], ids=["back_to_back", "xla_op_between"])
@pytest.mark.parametrize("kind", ["ag", "rs"])
def test_dependent_chain(kind, between, pdl):
  """Each fused GEMM reads the previous one's output (config overlap_pdl: launched before that kernel
  ended, it must wait for it): a chain of 6, directly or through an XLA kernel, against the same
  chain of f32 dots of the rounded inputs, every step rounded alike."""
  og = _og()
  import jax_dfccl
  M, K, steps = 1000, 520, 6  # 8 m tiles x 3 n tiles: a partial wave (a split on 132 SMs)
  x, w = _inputs(M, K, K, jnp.bfloat16, seed=11)
  op = (lambda a, b: og.all_gather_matmul(a, b, "one", 1)[0]) if kind == "ag" else (  # noqa: E731
      lambda a, b: og.matmul_reduce_scatter(a, b, "one", 1))
  nxt = (lambda y: (y * 0.75).astype(jnp.bfloat16)) if between else (lambda y: y)  # noqa: E731

  def chain(x, w):
    for _ in range(steps):
      x = nxt(op(x, w))
    return x

  mesh = Mesh(np.array(gpus()[:1]), ("one",))
  f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
  with jax_dfccl.configured(overlap_pdl=pdl):
    lowered = f.lower(x, w)
  text = lowered.as_text()
  assert text.count(f"dfccl_overlap_{kind}") >= steps
  assert bool(int(re.search(r"mode = (\d+)", text).group(1)) & og.MODE_NO_PDL) == (not pdl)
  g = lowered.compile()
  ref = x
  for _ in range(steps):
    ref = nxt(jnp.dot(ref.astype(jnp.float32), w.astype(jnp.float32)).astype(jnp.bfloat16))
  for it in range(3):
    _close(g(x, w), ref, jnp.bfloat16, f"{kind} chain pdl={pdl} between={between} iter {it}")
  _og().check()


_EXIT_PROBE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jax_dfccl._src import overlap_gpu as og
mesh = Mesh(np.array(jax.devices()[:1]), ("one",))
x = jax.random.normal(jax.random.key(0), (2048, 512), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (512, 4096), jnp.bfloat16)
f = jax.jit(jax.shard_map(lambda x, w: og.all_gather_matmul(x, w, "one", 1)[0], mesh=mesh, in_specs=(P(), P()),
                          out_specs=P()))
ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
err = float(jnp.max(jnp.abs(f(x, w).astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
assert err < 1e-2, err
print("ok")
"""


def test_process_exits_cleanly():
  """A process that ran a fused op exits with status 0: the module's watcher thread is stopped before the
  static destructors and CUDA's teardown (it reads the channels and their host-mapped mailboxes)."""
  _og()
  import os
  import subprocess
  import sys
  for _ in range(2):
    r = subprocess.run([sys.executable, "-c", _EXIT_PROBE], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                            "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout[-2000:], r.stderr[-2000:])

