"""Fused GPU kernels for the per-shard overlap ops (in extension ``_dfccl_cuda`` when built with CUTLASS).

On NVIDIA GPUs (sm90) ``all_gather_matmul`` and ``matmul_reduce_scatter`` of
:mod:`jax_dfccl._src.overlap` lower to one custom call each that runs a CUTLASS
sm90 GEMM with tile-wise signaling (see xla_ffi/overlap/):

* AG+GEMM: every rank copies its rows into the peers' gather buffers (copy
  engine on a side stream, or a small SM push kernel on the first call) while
  the GEMM multiplies its own rows, then each peer's row chunk as soon as its
  arrival flag is set.
* GEMM+RS: the GEMM computes the peers' row blocks first and stores each
  finished tile (input dtype) into its owner's receive buffer; the own block is
  computed last and adds the received partials in its epilogue (f32).

Used when: the default backend is GPU (sm90), ``_dfccl_cuda`` has them (``has_overlap``),
``jax_dfccl.config.overlap.fused`` (default True; ``fused(False)`` turns it off
inside a block), dtype bfloat16/float16,
2..8 ranks, and K, N multiples of 8 (RS: rows divisible by the ranks). Anything
else keeps the XLA-dot + collective schedule. Nothing here imports the
extension on CPU.

Each op instance is a collective of the GPU runtime like the others
(xla_ffi/runtime/overlap_path.h): named (communicator, key, sequence) -- the
key names the kind, shapes and dtype (``_key``), each call on a rank takes the
next sequence number of its (group, key) --, counted in
``jax_dfccl.stats()["cuda"]``, listed by ``jax_dfccl.pending()``, recorded in
the trace, and bounded by ``jax_dfccl.config.timeout_s`` (read at run time): a
peer that never arrives fails it with ``DEADLINE_EXCEEDED`` naming the key,
the sequence number and the missing ranks, raised by ``jax_dfccl.raise_if_failed()``
and the device's next collective call (docs/design/overlap.md).  ``overlap_copy_engine`` (AG rows moved by the copy engine instead
of the SM push kernel), ``overlap_cta_fence`` (RS: one system fence per CTA
and tile) ``overlap_rs_copy_engine_min_bytes`` (RS partial blocks at least
that large moved by the copy engine), ``overlap_cluster_m`` (the GEMM's
2x1-cluster variant), ``overlap_split_last_wave`` (a partial last wave's
tiles split along k) and ``overlap_pdl`` (programmatic dependent launch of the
GEMM) travel as the `mode` attribute.

Diagnostics (benchmarks/overlap_diag.py): ``profile(True)`` makes the kernels
record CUDA-event times and a per-tile device timeline of every fused launch,
``profile_results()`` collects them (summaries and whole timelines, see
xla_ffi/overlap/profile.cc); ``diag_mode(MODE_MAILBOX_ONLY)`` traces ops that
exchange readiness and addresses through the host-mapped mailbox only (the
first version's handshake), for comparisons.
"""
from __future__ import annotations

import contextlib
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore
from jax._src.interpreters import batching, mlir

from jax_dfccl._src import compat
from jax_dfccl._src import core as dcore

__all__ = ["fused", "available", "loaded", "applies", "all_gather_matmul", "matmul_reduce_scatter",
           "check", "profile", "profile_results", "diag_mode", "MODE_MAILBOX_ONLY", "MODE_CLUSTER_M2",
           "MODE_NO_SPLIT", "MODE_CLUSTER_AUTO", "MODE_NO_PDL",
           "MODE_TILE_SHIFT", "MODE_RASTER_SHIFT", "RASTERS", "MODE_TMA_STORE", "MODE_TMA_STORE_AUTO",
           "MODE_PINGPONG",
           "TILE_NS"]

FUSED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_RANKS = 8

_enabled: list = [None]  # None: jax_dfccl.config.overlap.fused
_diag_bits: list = [0]   # extra `mode` bits of ops traced inside diag_mode()
MODE_MAILBOX_ONLY = 8    # protocol.h kModeMailboxOnly
MODE_CLUSTER_M2 = 16     # protocol.h kModeClusterM2 (config overlap_cluster_m == 2)
MODE_NO_SPLIT = 32       # protocol.h kModeNoSplit (config overlap_split_last_wave False)
MODE_CLUSTER_AUTO = 64   # protocol.h kModeClusterAuto (config overlap_cluster_m == 0)
MODE_NO_PDL = 128        # protocol.h kModeNoPdl (config overlap_pdl False)
MODE_TILE_SHIFT = 8      # protocol.h kModeTileShift: 1 + the index in TILE_NS of a forced tile width
MODE_RASTER_SHIFT = 10   # protocol.h kModeRasterShift: 1 + the index of a forced tile order in kRasters
RASTERS = 6              # len(protocol.h kRasters)
MODE_TMA_STORE = 8192    # protocol.h kModeTmaStore (config overlap_tma_store)
MODE_TMA_STORE_AUTO = 16384  # protocol.h kModeTmaStoreAuto (config overlap_tma_store=None)
MODE_PINGPONG = 32768    # protocol.h kModePingpong (config overlap_pingpong=True)
TILE_NS = (128, 192, 256)  # protocol.h kTileNs (config overlap_tile_n)
_lock = threading.Lock()
_mod: list = []  # [module or None] once tried


@contextlib.contextmanager
def _setting(cell: list, value):
  """Sets the trace-time setting `cell[0]` inside the block."""
  old, cell[0] = cell[0], value
  try:
    yield
  finally:
    cell[0] = old


def fused(enabled: bool):
  """Whether ops traced inside the block use the fused GPU kernels (when they apply)."""
  return _setting(_enabled, bool(enabled))


def _config():
  from jax_dfccl.config import config  # noqa: PLC0415
  return config


def _gpu() -> bool:
  """Default backend GPU and every GPU an sm90 (the kernels are built for sm_90a)."""
  try:
    if jax.default_backend() != "gpu":
      return False
    return all(str(getattr(d, "compute_capability", "")) == "9.0" for d in jax.devices("gpu"))
  except RuntimeError:
    return False


def module():
  """The ``_dfccl_cuda`` module when it holds the fused ops (``has_overlap``: built
  with CUTLASS) and the GPUs are sm90, else None.

  ``jax_dfccl._src.backend.load()`` loads, configures and registers it: its
  ``registrations()`` include the fused targets (``dfccl_overlap_ag``,
  ``dfccl_overlap_rs``), and their instances' stats, pending report, trace
  records and failures are the runtime's own.
  """
  with _lock:
    if not _mod:
      mod = None
      if _gpu():
        from jax_dfccl._src import backend  # noqa: PLC0415
        try:
          cuda = backend.load().get("cuda")
        except ImportError:
          cuda = None
        if cuda is not None and getattr(cuda, "has_overlap", False):
          mod = cuda
      _mod.append(mod)
    return _mod[0]


def loaded():
  """The module :func:`module` found, if it was looked for already, else None (loads nothing)."""
  return _mod[0] if _mod else None


def available() -> bool:
  return module() is not None


def applies(kind, x, w, nranks) -> bool:
  """Whether the fused kernel runs this per-shard op (decided at trace time)."""
  on = _enabled[0] if _enabled[0] is not None else _config().overlap.fused
  if not on or jnp.dtype(x.dtype) not in FUSED_DTYPES or not 2 <= nranks <= MAX_RANKS:
    return False
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] % 8 or w.shape[1] % 8 or 0 in x.shape + w.shape:
    return False
  if kind == "rs" and x.shape[0] % nranks:
    return False
  return available()


def check():
  """Raises the recorded failure of a fused op (RuntimeError), as :func:`jax_dfccl.raise_if_failed`
  does for every collective; nothing when none failed or the module is not loaded."""
  mod = loaded()
  if mod is not None:
    mod.raise_if_failed()


# ---------------------------------------------------------------------------
# Diagnostics


def diag_mode(bits: int):
  """Ops traced inside the block carry these extra `mode` bits (e.g. MODE_MAILBOX_ONLY)."""
  return _setting(_diag_bits, int(bits))


def profile(on: bool, no_comm: bool = False):
  """Turns profiling of the fused launches on or off (every launch from then on).

  no_comm runs the fused GEMMs without waits or remote stores (their GEMM
  alone; results invalid).  Raises RuntimeError without the GPU module.
  """
  mod = module()
  if mod is None:
    raise RuntimeError("jax_dfccl fused overlap ops not available (need sm90 GPUs and _dfccl_cuda built with CUTLASS)")
  mod._set_diag(bool(no_comm), bool(on))


def profile_results() -> dict:
  """Collects (and clears) what the profiled launches recorded.

  Returns {"events": [(name, ms), ...], "timelines": [dict, ...]}: events are
  the CUDA-event times ("<key>|gemm", "|copy", "|push"), handler wall times
  ("|host") and per-launch summaries ("|tl_<what>"); every timeline is one
  launch on one rank: key, rank, kind, per_block, tiles, grid, side, host_ns
  (handler entry, host clock), base_ns (earliest device time of the launch,
  globaltimer), kernel [start, announced], tile rows [tile, sm, got, mma_done,
  waits_done, done, row_wait_start, row_wait_end] and side rows [peer,
  wait_start, ready_seen, signal], in ns from base_ns (-1: not recorded).
  """
  mod = module()
  if mod is None:
    return {"events": [], "timelines": []}
  events, timelines = [], []
  for name, ms in mod._profile_results():
    if "|tlraw|" in name:
      timelines.append(json.loads(name.split("|tlraw|", 1)[1]))
    else:
      events.append((name, ms))
  return {"events": events, "timelines": timelines}


# ---------------------------------------------------------------------------
# Primitive: one custom call per op instance and rank.

fused_p = jcore.Primitive("dfccl_overlap_fused")
fused_p.multiple_results = True


def _abstract(x, w, *, kind, axis, nranks, gather):
  vma = compat.varying(x) | compat.varying(w)
  if kind == "ag":
    outs = [compat.with_shape_vma(x, (nranks * x.shape[0], w.shape[1]), vma)]
    outs.append(compat.with_shape_vma(x, (nranks * x.shape[0] if gather else 0, x.shape[1]), vma))
  else:
    outs = [compat.with_shape_vma(x, (x.shape[0] // nranks, w.shape[1]), vma)]
  # No jax_dfccl effect: an effect-free program keeps jax.jit's C++ fast
  # dispatch path (any effect sends every call through Python dispatch).  The
  # custom call is still has_side_effect (never removed or merged by XLA), and
  # every rank runs the same program, so the per-channel call sequence matches.
  return outs, {jcore.NamedAxisEffect(axis)}


fused_p.def_effectful_abstract_eval(_abstract)


def _no_impl(*args, **params):
  raise ValueError("jax_dfccl fused overlap ops run only inside jax.shard_map under jax.jit")


fused_p.def_impl(_no_impl)


def _lowering(ctx, x, w, *, kind, axis, nranks, gather):
  module()  # registers the FFI targets where the module loads (ops bound without applies() first)
  mesh = dcore._spmd_mesh(ctx, "overlap")
  groups = dcore.group_table(mesh, (axis,))
  if groups.shape[1] != nranks:
    raise ValueError(f"jax_dfccl overlap: axis {axis!r} has {groups.shape[1]} devices, traced for {nranks}")
  devs = dcore.device_ids(mesh)[groups].reshape(-1).astype(np.int64)
  xa, wa = ctx.avals_in
  rule = jax.ffi.ffi_lowering("dfccl_overlap_" + kind, has_side_effect=True)
  cfg = _config()
  block_bytes = (xa.shape[0] // nranks) * wa.shape[1] * np.dtype(xa.dtype).itemsize  # RS: one rank's rows
  return rule(ctx, x, w, key=_key(kind, xa, wa), devices=devs, group_size=np.int32(nranks),
              mode=np.int32(_mode(cfg, kind, nranks, block_bytes)))


def _key(kind, xa, wa) -> str:
  """The collective key of a fused op: its kind, per-shard shapes and dtype
  (``ag:512x256@256x1024:bfloat16``).  With the device group it names the op's
  channel (its buffers, sized by the first call); each call takes the channel's
  next sequence number, as every collective of a (group, key) does."""
  return (f"{kind}:{xa.shape[0]}x{xa.shape[1]}@{wa.shape[0]}x{wa.shape[1]}:"
          f"{np.dtype(xa.dtype).name}")


def _int_entry(section, name, allowed, what):
  """cfg.overlap.<name>, an int (not a bool, not a float) among `allowed`, else a ValueError naming the entry."""
  v = getattr(section, name)
  if not isinstance(v, int) or isinstance(v, bool) or v not in allowed:
    raise ValueError(f"jax_dfccl.config.overlap.{name} must be {what}, got {v!r}")
  return v


def _mode(cfg, kind, nranks, block_bytes) -> int:
  """The custom call's `mode` bits (xla_ffi/overlap/protocol.h, enum Mode)."""
  lim = cfg.overlap.rs_copy_engine_min_bytes
  rs_ce = kind == "rs" and nranks == 2 and lim >= 0 and block_bytes >= lim
  cluster_m = _int_entry(cfg.overlap, "cluster_m", (0, 1, 2), "0 (auto), 1 or 2")
  tile_n = _int_entry(cfg.overlap, "tile_n", (0, *TILE_NS), f"0 (auto) or one of {TILE_NS}")
  tile_bits = (TILE_NS.index(tile_n) + 1) << MODE_TILE_SHIFT if tile_n else 0
  raster = _int_entry(cfg.overlap, "raster", range(RASTERS + 1), f"0 (the plan's) or 1..{RASTERS}")
  tma = cfg.overlap.tma_store
  if tma is not None and not isinstance(tma, bool):
    raise ValueError(f"jax_dfccl.config.overlap.tma_store must be None (the plan's), True or False, got {tma!r}")
  tma_bits = MODE_TMA_STORE_AUTO if tma is None else MODE_TMA_STORE if tma else 0
  pp = cfg.overlap.pingpong
  if not isinstance(pp, bool):
    raise ValueError(f"jax_dfccl.config.overlap.pingpong must be True or False, got {pp!r}")
  if pp and (tile_n not in (0, 128) or cluster_m == 2):
    raise ValueError("jax_dfccl.config.overlap.pingpong=True runs 128-column tiles on 1x1 clusters: overlap_tile_n "
                     f"must be 0 or 128 and overlap_cluster_m 0 or 1, got {tile_n} and {cluster_m}")
  pp_bits = MODE_PINGPONG if pp else 0
  return ((1 if cfg.overlap.copy_engine else 0) | (2 if cfg.overlap.cta_fence else 0) | (4 if rs_ce else 0)
          | (MODE_CLUSTER_M2 if cluster_m == 2 else MODE_CLUSTER_AUTO if cluster_m == 0 else 0)
          | (0 if cfg.overlap.split_last_wave else MODE_NO_SPLIT) | (0 if cfg.overlap.pdl else MODE_NO_PDL)
          | tile_bits | (raster << MODE_RASTER_SHIFT) | tma_bits | pp_bits
          | _diag_bits[0])


mlir.register_lowering(fused_p, _lowering, platform="cuda")


def _batch(args, dims, **params):
  """vmap: one fused call per batch element (unrolled)."""
  x, w = args
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)  # None: not mapped
  x = batching.bdim_at_front(x, dims[0], size)
  w = batching.bdim_at_front(w, dims[1], size)
  outs = [fused_p.bind(x[i], w[i], **params) for i in range(size)]
  return [jnp.stack(o) for o in zip(*outs)], [0] * len(outs[0])


batching.primitive_batchers[fused_p] = _batch


def all_gather_matmul(x, w, axis, nranks, *, gather_x=False):
  """Per shard: (all_gather(x) @ w, all_gather(x) or None)."""
  out, xg = fused_p.bind(x, w, kind="ag", axis=axis, nranks=nranks, gather=bool(gather_x))
  return out, (xg if gather_x else None)


def matmul_reduce_scatter(x, w, axis, nranks):
  """Per shard: psum_scatter(x @ w, rows)."""
  (out,) = fused_p.bind(x, w, kind="rs", axis=axis, nranks=nranks, gather=False)
  return out
