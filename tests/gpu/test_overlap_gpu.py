"""GPU tests of the fused overlap kernels (run with `pytest -m gpu tests/gpu/test_overlap_gpu.py`).

Numerics against float32 references built from the same (rounded) inputs with
jnp.dot and jax.lax collectives; shapes include M, N, K that are not multiples
of the 128x256x64 tile; both ops, bfloat16 and float16, per shard (shard_map),
global (sharded jit) and gradients; the fused ops as collectives: counted in stats(), recorded
in the trace, a stuck one listed by pending() and failed with DEADLINE_EXCEEDED's words within
config.timeout_s (in a subprocess: its kernels trap).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


from jax_dfccl.testing import gpus  # noqa: E402
from peers import needs_peers  # noqa: E402  (tests/gpu/peers.py)

pytestmark = [pytest.mark.gpu, needs_peers]

if len(gpus()) >= 2:
  from jax_dfccl._src import overlap as ov
  from jax_dfccl._src import overlap_gpu as og
  MESH = Mesh(np.array(gpus()[:2]), ("tp",))

TOL = {jnp.bfloat16: 2.5e-2, jnp.float16: 4e-3}
LOSS_TOL = {jnp.bfloat16: 5e-3, jnp.float16: 1e-3}  # of a scalar loss (test_grads)
SPECS = {"ag": (P("tp", None), P(None, "tp"), P(None, "tp")),
         "rs": (P(None, "tp"), P("tp", None), P("tp", None))}
OPS = {"ag": lambda: ov.all_gather_matmul, "rs": lambda: ov.matmul_reduce_scatter}


def _inputs(M, N, K, dtype, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (M, K), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (K, N), jnp.float32) / K ** 0.5).astype(dtype)
  return x, w


def _put(a, spec):
  return jax.device_put(a, NamedSharding(MESH, spec))


def _close(got, ref, dtype, what):
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  assert got.shape == ref.shape, (what, got.shape, ref.shape)
  err = np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-6)
  assert np.isfinite(got).all() and err < TOL[dtype], f"{what}: max rel error {err:.3g}"


def _per_shard(kind, x, w):
  xs, ws, os_ = SPECS[kind]
  f = jax.jit(jax.shard_map(lambda x, w: OPS[kind]()(x, w, "tp"), mesh=MESH, in_specs=(xs, ws),
                            out_specs=os_))
  return f, (_put(x, xs), _put(w, ws))


def _ref(kind, x, w):
  """float32 reference: jnp.dot + jax.lax collectives on the rounded inputs."""
  xs, ws, os_ = SPECS[kind]
  x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
  if kind == "ag":
    body = lambda x, w: jnp.dot(lax.all_gather(x, "tp", tiled=True), w)  # noqa: E731
  else:
    body = lambda x, w: lax.psum_scatter(jnp.dot(x, w), "tp", tiled=True)  # noqa: E731
  f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(xs, ws), out_specs=os_))
  return f(_put(x32, xs), _put(w32, ws))


def test_fused_module_available():
  assert og.available(), "the fused ops of jax_dfccl._dfccl_cuda (has_overlap) did not load/register on this GPU machine"


# (kind, global M, N, K): tile multiples, odd multiples of 8, several tiles, K < 64
SHAPES = [("ag", 256, 512, 128), ("ag", 208, 272, 200), ("ag", 1024, 2048, 1024), ("ag", 48, 16, 8),
          ("rs", 256, 512, 256), ("rs", 272, 264, 240), ("rs", 1024, 1024, 2048), ("rs", 48, 16, 16)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("kind,M,N,K", SHAPES)
def test_per_shard_numerics(kind, M, N, K, dtype):
  x, w = _inputs(M, N, K, dtype)
  f, args = _per_shard(kind, x, w)
  assert f"dfccl_overlap_{kind}" in f.lower(*args).as_text(), "fused kernel not used"
  ref = _ref(kind, x, w)
  for it in range(3):  # repeated instances (flags carry the instance number)
    out = f(*args)
    _close(out, ref, dtype, f"{kind} {M}x{N}x{K} iter {it}")
  og.check()


def test_both_ops_in_one_program_and_chain():
  dtype = jnp.bfloat16
  x, w1 = _inputs(512, 1024, 256, dtype, seed=1)
  _, w2 = _inputs(1024, 256, 1024, dtype, seed=2)

  def body(x, w1, w2):  # Megatron MLP: AG+GEMM then GEMM+RS
    h = ov.all_gather_matmul(x, w1, "tp")
    return ov.matmul_reduce_scatter(h, w2, "tp")

  f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P("tp"), P(None, "tp"), P("tp")),
                            out_specs=P("tp")))
  args = (_put(x, P("tp")), _put(w1, P(None, "tp")), _put(w2, P("tp")))
  txt = f.lower(*args).as_text()
  assert "dfccl_overlap_ag" in txt and "dfccl_overlap_rs" in txt
  h = jnp.dot(x.astype(jnp.float32), w1.astype(jnp.float32)).astype(dtype)
  ref = jnp.dot(h.astype(jnp.float32), w2.astype(jnp.float32))
  for _ in range(5):
    out = f(*args)
  _close(out, ref, dtype, "mlp")
  og.check()


@pytest.mark.parametrize("kind", ["ag", "rs"])
def test_global_sharded_jit(kind):
  dtype = jnp.bfloat16
  x, w = _inputs(384, 640, 512, dtype, seed=3)
  xs, ws, os_ = SPECS[kind]
  f = jax.jit(lambda x, w: OPS[kind]()(x, w, "tp"))
  out = f(_put(x, xs), _put(w, ws))
  _close(out, jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)), dtype, f"global {kind}")
  txt = f.lower(_put(x, xs), _put(w, ws)).compile().as_text()
  assert f"dfccl_overlap_{kind}" in txt
  og.check()


@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_grads(kind, dtype):
  x, w = _inputs(256, 384, 256, dtype, seed=4)
  g = jax.random.normal(jax.random.key(6), (256, 384), jnp.float32)
  xs, ws, os_ = SPECS[kind]

  def loss(op, x, w):
    y = jax.shard_map(lambda x, w: op(x, w, "tp"), mesh=MESH, in_specs=(xs, ws), out_specs=os_)(x, w)
    return jnp.sum(y.astype(jnp.float32) * g)

  # value_and_grad: the forward op's result is needed (the fused custom call
  # carries no JAX effect, so under plain grad JAX drops the unused forward
  # of the linear loss, which is correct).
  ours = jax.jit(jax.value_and_grad(lambda x, w: loss(OPS[kind](), x, w), argnums=(0, 1)))
  args = (_put(x, xs), _put(w, ws))
  txt = ours.lower(*args).as_text()
  assert "dfccl_overlap_ag" in txt and "dfccl_overlap_rs" in txt
  val, (dx, dw) = ours(*args)
  x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
  rval, (rdx, rdw) = jax.value_and_grad(lambda x, w: jnp.sum(jnp.dot(x, w) * g), argnums=(0, 1))(x32, w32)
  # Relative to the loss (|rval| ~ 317): rounding the op's output to bf16 / f16 moves it by 1.2e-4 /
  # 2.0e-5 of that (numpy on the same inputs), so a wrong or zero forward result fails.
  assert abs(float(val) - float(rval)) <= LOSS_TOL[dtype] * abs(float(rval)), (val, rval)
  _close(dx, rdx, dtype, f"{kind} dx")
  _close(dw, rdw, dtype, f"{kind} dw")
  og.check()


def test_fallback_when_disabled_and_f32():
  x, w = _inputs(256, 256, 128, jnp.float32)
  f, args = _per_shard("ag", x, w)
  assert "dfccl_overlap" not in f.lower(*args).as_text()  # f32: XLA path
  x, w = _inputs(256, 256, 128, jnp.bfloat16)
  with og.fused(False):
    f, args = _per_shard("ag", x, w)
    assert "dfccl_overlap" not in f.lower(*args).as_text()


def test_vmap_per_shard():
  dtype = jnp.bfloat16
  kx, kw = jax.random.split(jax.random.key(7))
  x = jax.random.normal(kx, (2, 256, 128), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (2, 128, 256), jnp.float32) / 128 ** 0.5).astype(dtype)
  body = jax.vmap(lambda x, w: ov.all_gather_matmul(x, w, "tp"))
  f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P(None, "tp"), P(None, None, "tp")),
                            out_specs=P(None, None, "tp")))
  args = (_put(x, P(None, "tp")), _put(w, P(None, None, "tp")))
  assert "dfccl_overlap_ag" in f.lower(*args).as_text()
  ref = jnp.einsum("bmk,bkn->bmn", x.astype(jnp.float32), w.astype(jnp.float32))
  _close(f(*args), ref, dtype, "vmap ag")
  og.check()


@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("copy_engine,cta_fence,rs_ce", [(False, False, False), (True, True, False),
                                                         (True, True, True)], ids=["sm-push", "ce", "rs-ce"])
def test_modes(kind, copy_engine, cta_fence, rs_ce):
  """The transfer / fence schemes (jax_dfccl.config, traced into `mode`)."""
  import jax_dfccl
  with jax_dfccl.configured(overlap_copy_engine=copy_engine, overlap_cta_fence=cta_fence,
                            overlap_rs_copy_engine_min_bytes=0 if rs_ce else -1):
    dtype = jnp.bfloat16
    x, w = _inputs(512, 768, 384, dtype, seed=8)
    f, args = _per_shard(kind, x, w)
    rs_bit = 4 * int(rs_ce and kind == "rs")
    assert f"mode = {int(copy_engine) | 2 * int(cta_fence) | rs_bit}" in f.lower(*args).as_text()
  ref = _ref(kind, x, w)
  for it in range(4):  # copy engine: from the second instance on (peer buffers known)
    _close(f(*args), ref, dtype, f"{kind} mode {copy_engine},{cta_fence} iter {it}")
  og.check()


@pytest.mark.parametrize("kind", ["ag", "rs"])
def test_profile_timeline(kind):
  """The diagnostic timeline (profile mode) is filled and leaves results correct."""
  dtype = jnp.bfloat16
  x, w = _inputs(512, 1024, 256, dtype, seed=9)
  f, args = _per_shard(kind, x, w)
  ref = _ref(kind, x, w)
  _close(f(*args), ref, dtype, f"{kind} warm-up")
  og.profile(True)
  try:
    outs = [f(*args) for _ in range(2)]
    jax.block_until_ready(outs)
  finally:
    og.profile(False)
  res = og.profile_results()
  for out in outs:
    _close(out, ref, dtype, f"{kind} profiled")
  ev = res["events"]
  spans = [ms for k, ms in ev if k.endswith("|tl_span")]
  assert len(spans) == 4 and all(0 < s < 1e3 for s in spans), ev  # 2 calls x 2 ranks
  if kind == "ag":
    assert any(k.endswith("|tl_copy") for k, _ in ev), ev
  tls = res["timelines"]
  assert len(tls) == 4 and {t["rank"] for t in tls} == {0, 1}, [t.get("rank") for t in tls]
  for t in tls:
    assert t["kind"] == kind and len(t["tile"]) == t["tiles"], (t["kind"], len(t["tile"]), t["tiles"])
    assert t["kernel"][0] >= 0 and t["kernel"][1] >= t["kernel"][0], t["kernel"]
    assert all(0 <= row[2] <= row[3] <= row[4] <= row[5] for row in t["tile"]), t["tile"][:4]
    assert t["host_ns"] > 0
  og.check()


@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("rs_ce", [False, True], ids=["sm", "ce"])
def test_mailbox_only_and_back(kind, rs_ce):
  """The host-mailbox handshake (diag_mode) and the device-memory announcements give the same
  results, also when programs of both kinds alternate on one channel."""
  from jax_dfccl.config import config
  dtype = jnp.bfloat16
  x, w = _inputs(512, 768, 384, dtype, seed=11)
  old = config.overlap.rs_copy_engine_min_bytes
  config.overlap.rs_copy_engine_min_bytes = 0 if rs_ce else -1
  try:
    f, args = _per_shard(kind, x, w)
    f.lower(*args)
    with og.diag_mode(og.MODE_MAILBOX_ONLY):
      g = jax.jit(jax.shard_map(lambda x, w: OPS[kind]()(x, w, "tp"), mesh=MESH,
                                in_specs=SPECS[kind][:2], out_specs=SPECS[kind][2]))
      bits = 1 | 2 | 8 | (4 if rs_ce and kind == "rs" else 0)  # copy engine, CTA fence, mailbox only
      assert f"mode = {bits}" in g.lower(*args).as_text()
  finally:
    config.overlap.rs_copy_engine_min_bytes = old
  ref = _ref(kind, x, w)
  for it in range(6):  # same op key: one channel, instances of both schemes interleaved
    _close((f if it % 3 else g)(*args), ref, dtype, f"{kind} iter {it}")
  og.check()


# (kind, global M, N, K) for the 2x1-cluster GEMM: per-rank row blocks of 3, 1 and 5 m tiles
# (odd: the last pair's second tile lies below the block), no dimension a multiple of 128.
CLUSTER_SHAPES = [("ag", 656, 528, 200), ("ag", 96, 272, 136), ("ag", 1200, 1040, 1000),
                  ("rs", 656, 264, 464), ("rs", 96, 136, 272), ("rs", 1200, 520, 1008)]


def _traced_with(settings, kind, x, w):
  """A per-shard program traced, checked for its `mode` and compiled under `settings` (config)."""
  import jax_dfccl
  with jax_dfccl.configured(**settings):
    f, args = _per_shard(kind, x, w)
    mode = int(re.search(r"mode = (\d+)", f.lower(*args).as_text()).group(1))
    assert bool(mode & og.MODE_CLUSTER_M2) == (settings.get("overlap_cluster_m", 1) == 2), mode
    jax.block_until_ready(f(*args))  # compiled (and run once) with these settings
  return f, args


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rs_ce", [False, True], ids=["sm", "ce"])
@pytest.mark.parametrize("kind,M,N,K", CLUSTER_SHAPES)
def test_cluster_m2_numerics(kind, M, N, K, dtype, rs_ce):
  """overlap_cluster_m=2 (tile pairs on 2x1 clusters, W multicast) against the f32 reference,
  alternating with the 1x1 kernel on the same channel (one tile counter for both)."""
  x, w = _inputs(M, N, K, dtype, seed=13)
  lim = 0 if rs_ce else -1
  f2, args = _traced_with({"overlap_cluster_m": 2, "overlap_rs_copy_engine_min_bytes": lim}, kind, x, w)
  f1, _ = _traced_with({"overlap_cluster_m": 1, "overlap_rs_copy_engine_min_bytes": lim}, kind, x, w)
  ref = _ref(kind, x, w)
  for it in range(6):  # copy engines from the second instance on; variants interleaved
    _close((f1 if it % 3 == 2 else f2)(*args), ref, dtype, f"{kind} {M}x{N}x{K} cluster iter {it}")
  og.check()


# (global M, N, K) of AG+GEMM for the bulk tensor stores across row blocks (every tile goes to the rank's own
# output, 2 row blocks of M / 2 rows): blocks that end inside a tile (200 and 328 rows: a box must clip at its
# block's end, not run into the next block), n an odd multiple of 8, and a multi-wave launch (16 x 16 tiles).
TMA_SHAPES = [(400, 528, 200), (656, 1040, 1000), (2000, 8000, 512)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("M,N,K", TMA_SHAPES)
def test_tma_store_row_blocks(M, N, K, dtype):
  """overlap_tma_store=True on 2 ranks (AG: the 3-D output tensor map's block coordinate) and the default (the
  plan's choice) against the f32 reference, alternating with the threads' stores on the same channel."""
  x, w = _inputs(M, N, K, dtype, seed=17)
  ft, args = _traced_with({"overlap_tma_store": True}, "ag", x, w)
  fd, _ = _traced_with({"overlap_tma_store": None}, "ag", x, w)
  fp, _ = _traced_with({"overlap_tma_store": False}, "ag", x, w)
  ref = _ref("ag", x, w)
  for it in range(6):
    _close((ft, fd, fp)[it % 3](*args), ref, dtype, f"ag {M}x{N}x{K} tma {(True, None, False)[it % 3]} iter {it}")
  og.check()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rs_ce", [False, True], ids=["sm", "ce"])
@pytest.mark.parametrize("kind,M,N,K", CLUSTER_SHAPES)
def test_pingpong_numerics(kind, M, N, K, dtype, rs_ce):
  """overlap_pingpong=True on 2 ranks (each consumer warp group with its own tiles: AG row waits, RS partials
  into the peer and the own block's fold, once per group and peer) against the f32 reference, alternating with the
  cooperative schedule on the same channel."""
  x, w = _inputs(M, N, K, dtype, seed=19)
  lim = 0 if rs_ce else -1
  fp, args = _traced_with({"overlap_pingpong": True, "overlap_rs_copy_engine_min_bytes": lim}, kind, x, w)
  fc, _ = _traced_with({"overlap_pingpong": False, "overlap_rs_copy_engine_min_bytes": lim}, kind, x, w)
  ref = _ref(kind, x, w)
  for it in range(6):
    _close((fc if it % 3 == 2 else fp)(*args), ref, dtype, f"{kind} {M}x{N}x{K} pingpong iter {it}")
  og.check()


_FIRST_CALL = r"""
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax_dfccl._src import overlap as ov, overlap_gpu as og
from jax_dfccl.config import config
config.overlap.rs_copy_engine_min_bytes = 0  # the copy engine from the first instance on
config.timeout_s = 5.0
mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
rng = np.random.default_rng(0)
x = rng.standard_normal((1024, 768)).astype(np.float32)
w = (rng.standard_normal((768, 1024)) / 28).astype(np.float32)
f = jax.jit(jax.shard_map(lambda x, w: ov.matmul_reduce_scatter(x, w, "tp"), mesh=mesh,
                          in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
xb = jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, P(None, "tp")))
wb = jax.device_put(jnp.asarray(w, jnp.bfloat16), NamedSharding(mesh, P("tp", None)))
ref = np.asarray(xb, np.float32) @ np.asarray(wb, np.float32)
for _ in range(3):
  got = np.asarray(f(xb, wb), np.float32)
  err = np.abs(got - ref).max() / np.abs(ref).max()
  assert err < 2.5e-2, err
og.check()
print("OK")
"""


def test_rs_copy_engine_first_call_in_fresh_process():
  """The copy-engine RS as the very first fused op of a process: its side stream's wait kernel
  spins while the GEMM launches; the kernels are loaded beforehand, so the launch does not wait
  for the device to go idle (lazy module loading) and the op does not time out."""
  import os
  import subprocess
  import sys
  r = subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True, text=True, timeout=120,
                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
  assert r.returncode == 0 and "OK" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


# ---------------------------------------------------------------------------------------------
# The fused ops as collectives: stats, trace, pending, failure (docs/design/overlap.md, "Keys,
# counts and failures").


def _fused_ag(M, N, K):
  """A fused AG+GEMM program on MESH and its inputs; its per-shard key (overlap_gpu._key's words)."""
  x, w = _inputs(M, N, K, jnp.bfloat16, seed=3)
  f, args = _per_shard("ag", x, w)
  return f, args, f"ag:{M // 2}x{K}@{K}x{N // 2}:bfloat16", (x, w)


def test_fused_ops_counted_in_stats():
  import jax_dfccl as dc
  f, args, _, (x, w) = _fused_ag(256, 512, 128)
  jax.block_until_ready(f(*args))  # compiled, channel set up
  mod = og.loaded()
  assert mod is not None and mod.has_overlap  # the fused ops are the CUDA runtime's (_dfccl_cuda)
  before = dc.stats()["cuda"]
  calls = 3
  for _ in range(calls):
    out = f(*args)
  jax.block_until_ready(out)
  after = dc.stats()["cuda"]
  ref = _ref("ag", x, w)
  _close(out, ref, jnp.bfloat16, "ag counted")
  # One instance per rank and call (2 ranks), all completed: the stream's done word precedes the
  # program's end, and stats() reads it (the proxy's poll, or stats() itself).  Nothing else runs
  # meanwhile: exact.
  assert after["started"] - before["started"] == 2 * calls
  assert after["completed"] - before["completed"] == 2 * calls
  assert after["failed"] == before["failed"] and after["pending"] == before["pending"]
  assert after["pending"] == after["started"] - after["completed"] - after["failed"]
  assert after["overlap_channels"] >= 1
  assert set(after) == backend_keys()
  og.check()


def backend_keys():
  from jax_dfccl._src import backend
  return set(backend.STATS_KEYS) | set(backend.STATS_EXTRAS["cuda"])


def test_fused_ops_in_the_trace():
  import jax_dfccl as dc
  from jax_dfccl import trace
  f, args, key, _ = _fused_ag(2 * 136, 2 * 152, 136)  # a key of this test only
  with dc.configured(trace=True):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
  recs = [r for r in trace.records() if r[0] == "cuda" and r[2] == key]
  devs = sorted(d.id for d in MESH.devices.flat)
  by = {}
  for _, dev, _, seq, ev, t in recs:
    by.setdefault((dev, seq), []).append((ev, t))
  # Two instances per device, sequence numbers 1 and 2 of the key, each start <= run <= finish.
  assert sorted(by) == [(d, s) for d in devs for s in (1, 2)], sorted(by)
  for ident, evs in by.items():
    names = [e for e, _ in sorted(evs, key=lambda e: e[1])]
    assert names == ["start", "run", "finish"], (ident, evs)
  # One stream per device: the second instance finishes after the first.
  for d in devs:
    assert dict(by[(d, 1)])["finish"] <= dict(by[(d, 2)])["finish"]
  og.check()


_STUCK = r"""
import json, os, sys, threading, time
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_dfccl as dc
from jax_dfccl._src import overlap as ov
from jax_dfccl.testing import gpus
TIMEOUT = 2.0
devs = gpus()[:2]
mesh = Mesh(np.array(devs), ("tp",))
dc.configure(timeout_s=TIMEOUT)
print("DEVICES", json.dumps([d.id for d in devs]), flush=True)
specs = dict(in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"))
put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
# A fused op both ranks run: counted, and the kernels loaded before the timed part.
g = jax.jit(jax.shard_map(lambda x, w: ov.all_gather_matmul(x, w, "tp"), mesh=mesh, **specs))
xg, wg = put(jnp.ones((256, 128), jnp.bfloat16), P("tp", None)), put(jnp.ones((128, 256), jnp.bfloat16), P(None, "tp"))
s0 = dc.stats()["cuda"]
jax.block_until_ready(g(xg, wg))
s1 = dc.stats()["cuda"]
print("WARM", json.dumps({k: s1[k] - s0[k] for k in ("started", "completed", "failed")}), flush=True)
# Rank 1 never runs the stuck op: rank 0's instance waits for it.
def body(x, w):
  fused = lambda x, w: ov.all_gather_matmul(x, w, "tp")
  other = lambda x, w: jnp.zeros((x.shape[0] * 2, w.shape[1]), x.dtype)
  return jax.lax.cond(jax.lax.axis_index("tp") == 0, fused, other, x, w)
f = jax.jit(jax.shard_map(body, mesh=mesh, check_vma=False, **specs))
xs, ws = put(jnp.ones((512, 256), jnp.bfloat16), P("tp", None)), put(jnp.ones((256, 512), jnp.bfloat16), P(None, "tp"))
c = f.lower(xs, ws).compile()
res = {}
def run():
  t0 = time.monotonic()
  try:
    jax.block_until_ready(c(xs, ws))
    res["outcome"] = "RESULT"
  except Exception as e:
    res["outcome"] = "FAILED " + type(e).__name__
  res["elapsed"] = time.monotonic() - t0
t = threading.Thread(target=run)
t.start()
time.sleep(TIMEOUT / 2)
print("PENDING", json.dumps(dc.pending()), flush=True)
s2 = dc.stats()["cuda"]
print("MID", json.dumps({k: s2[k] - s1[k] for k in ("started", "completed", "failed", "pending")}), flush=True)
t.join(120)
print("OUTCOME", json.dumps(res), flush=True)
try:
  dc.raise_if_failed()
  print("RAISED", json.dumps(""), flush=True)
except RuntimeError as e:
  print("RAISED", json.dumps(str(e)), flush=True)
s3 = dc.stats()["cuda"]
print("END", json.dumps({k: s3[k] - s1[k] for k in ("started", "completed", "failed", "pending")}), flush=True)
print("ERRORS", json.dumps(s3["errors"]), flush=True)
try:  # the device's next fused call raises it too (or XLA's CUDA error first: the context is lost)
  jax.block_until_ready(c(xs, ws))
  print("NEXT", json.dumps("ran"), flush=True)
except Exception as e:
  print("NEXT", json.dumps(str(e)[:2000]), flush=True)
os._exit(0)
"""


def _tagged(out, tag):
  import json
  lines = [ln for ln in out.splitlines() if ln.startswith(tag + " ")]
  assert lines, (tag, out[-4000:])
  return json.loads(lines[0][len(tag) + 1:])


def test_stuck_fused_op_is_pending_then_fails_within_timeout_s():
  """Rank 1 never starts the op: pending() names it as the rank rank 0 waits for; the program fails
  within timeout_s + 1 s; raise_if_failed() raises DEADLINE_EXCEEDED's words (key, sequence, group,
  missing rank) and stats() counts one failed instance and keeps the message."""
  import os
  import subprocess
  import sys
  timeout_s = 2.0
  r = subprocess.run([sys.executable, "-c", _STUCK], capture_output=True, text=True, timeout=300,
                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                          "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"})
  out = r.stdout + r.stderr
  d0, d1 = _tagged(r.stdout, "DEVICES")
  assert _tagged(r.stdout, "WARM") == {"started": 2, "completed": 2, "failed": 0}, out
  # Per shard x (256, 256), w (256, 256): the key's first instance on the group (d0, d1).
  name = f"dfccl: collective 'ag:256x256@256x256:bfloat16' (sequence 1, group of GPUs [{d0},{d1}])"
  pending = _tagged(r.stdout, "PENDING")
  lines = [ln for ln in pending.splitlines() if name in ln]
  assert len(lines) == 1, pending
  assert lines[0].startswith(f"GPU {d0}: fused all_gather_matmul {name} rank 0,"), lines[0]
  assert "started S., this stream reached it" in lines[0], lines[0]
  assert lines[0].endswith(f"waiting for rank(s) [1 (GPU {d1})]: never started it"), lines[0]
  assert _tagged(r.stdout, "MID") == {"started": 1, "completed": 0, "failed": 0, "pending": 1}, out
  outcome = _tagged(r.stdout, "OUTCOME")
  assert outcome["outcome"].startswith("FAILED"), out  # never a result
  assert outcome["elapsed"] <= timeout_s + 1.0, outcome
  want = f"{name} timed out after 2 s: rank(s) [1 (GPU {d1})] never started it"
  raised = _tagged(r.stdout, "RAISED")
  assert raised.startswith(want), (raised, want)
  assert _tagged(r.stdout, "END") == {"started": 1, "completed": 0, "failed": 1, "pending": 0}, out
  assert any(e.startswith(want) for e in _tagged(r.stdout, "ERRORS")), out
  assert want in r.stderr, r.stderr[-3000:]  # printed as it happened
  nxt = _tagged(r.stdout, "NEXT")
  assert nxt != "ran", out
