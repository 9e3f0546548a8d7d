"""GEMM + communication overlap: all_gather_matmul, matmul_reduce_scatter, matmul_psum.

Two calling conventions, chosen by context (no separate namespace to learn):

* **Per shard** — inside ``jax.shard_map`` (``axis_name`` is a bound manual axis)
  the ops have the per-shard meaning of the jax.lax compositions they replace::

    all_gather_matmul(x, w, a)     == all_gather(x, a, axis=0, tiled=True) @ w
    matmul_reduce_scatter(x, w, a) == psum_scatter(x @ w, a, scatter_dimension=0, tiled=True)
    matmul_psum(x, w, a)           == psum(x @ w, a)

* **Global arrays** — anywhere else (plain ``jax.jit`` over ``NamedSharding``-ed
  arrays) ``x`` and ``w`` are global arrays and every op is the global ``x @ w``;
  the op fixes the Megatron shardings over mesh axis ``a`` and partitions itself
  through ``custom_partitioning`` (Shardy ``sharding_rule``), calling the per-shard
  code on each device:

  ==========================  ==============  ==============  ==============
  op                          x               w               result
  ==========================  ==============  ==============  ==============
  all_gather_matmul           P(a, None)      P(None, a)      P(None, a)
  matmul_reduce_scatter       P(None, a)      P(a, None)      P(a, None)
  matmul_psum                 P(None, a)      P(a, None)      P(None, None)
  ==========================  ==============  ==============  ==============

  Inputs sharded otherwise are resharded by XLA. The mesh comes from the inputs'
  sharding or from ``jax.set_mesh``; Explicit and Auto mesh axes both work.

Numerics: bfloat16 / float16 / float32 inputs (x and w of one dtype); every GEMM
accumulates in float32 (``preferred_element_type``); results are in the input
dtype. The ring GEMM+RS (every path but the fused GPU kernel) sends its partial
sums in float32, so the n-1 additions of a block accumulate in float32 (rounded
once, at the end: about half jax.lax's error for bf16 on 8 ranks); matmul_psum's
partials travel in the input dtype, as with ``psum(x @ w)``.

Schedule (CommFuse's tail-free P2P order), built from start/done collectives so
that the transfer of one block overlaps the GEMM of the next:

* AG+GEMM: ring over ``P`` ranks; step ``s`` multiplies the shard of rank
  ``r+s`` while it forwards that shard to rank ``r-1``; step 0 is the local shard,
  and nothing is sent after the last GEMM.
* GEMM+RS: step ``s`` computes the row block of rank ``r-s-1``, adds the partial
  received from rank ``r-1`` and sends the sum to rank ``r+1``; the last step is
  the rank's own block with the received partial folded in — no communication
  after the last GEMM.
* GEMM+AR: the rows are cut into ``num_chunks`` chunks and each chunk's psum runs
  while the next chunk is multiplied. An all-reduce has an unavoidable tail (every
  rank needs every other rank's last partial), here the psum of one chunk.

On NVIDIA GPUs with the fused ops built into ``_dfccl_cuda`` (CUTLASS), the per-shard
``all_gather_matmul`` / ``matmul_reduce_scatter`` on bfloat16/float16 instead run
one fused sm90 GEMM with tile-wise signaling each (same schedule order and numerics contract; see
:mod:`jax_dfccl._src.overlap_gpu`); everything else uses the schedule above.

The collectives are jax_dfccl's (order-free start/done; on CPU the dfccl CPU
backend, on GPU the daemon-kernel runtime) by default, or jax.lax's; see
:func:`collectives`. Differentiation (custom VJPs): the gradient of
``all_gather_matmul`` w.r.t. ``x`` is a ``matmul_reduce_scatter`` and that of
``matmul_reduce_scatter`` an ``all_gather_matmul``, each with the same overlap;
``jax.vmap`` over leading dimensions works in the per-shard form.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as jcore
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_dfccl._src import compat

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_psum", "collectives"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
DEFAULT_PSUM_CHUNKS = 4

# ---------------------------------------------------------------------------
# Collectives: jax_dfccl's (default) or jax.lax's (one indirection)

_backend = ["dfccl"]


@contextlib.contextmanager
def collectives(backend: str):
  """Selects the collectives the overlap ops are built from while tracing.

  ``"dfccl"`` (default): jax_dfccl's start/done collectives (order-free);
  ``"lax"``: jax.lax's (XLA's async collectives, scheduled by XLA). Applies to
  functions traced inside the ``with`` block (retrace to switch)."""
  if backend not in ("dfccl", "lax"):
    raise ValueError(f"collectives: backend must be 'dfccl' or 'lax', got {backend!r}")
  old, _backend[0] = _backend[0], backend
  try:
    yield
  finally:
    _backend[0] = old


class _LaxComm:
  """jax.lax collectives behind the start/done surface; XLA schedules the overlap."""
  name, ordered = "lax", False

  @staticmethod
  def ppermute_start(x, axis, perm):
    return lax.ppermute(x, axis, perm)

  @staticmethod
  def psum_start(x, axis):
    return lax.psum(x, axis)

  @staticmethod
  def done(h):
    return h


class _DfcclComm:
  """jax_dfccl start/done collectives; ``ordered``: the GEMM is pinned between
  start and done with optimization barriers (see :func:`_pin`)."""
  name, ordered = "dfccl", True

  def __init__(self, mod):
    self.mod = mod

  def ppermute_start(self, x, axis, perm):
    return self.mod.ppermute_start(x, axis, perm)

  def psum_start(self, x, axis):
    return self.mod.psum_start(x, axis)

  def done(self, h):
    return self.mod.done(h)


def _comm():
  if _backend[0] == "lax":
    return _LaxComm
  import jax_dfccl  # noqa: PLC0415  (lazy: jax_dfccl imports this module)
  return _DfcclComm(jax_dfccl)


def _pin(comm, handle, *xs):
  """For start/done collectives: ties ``xs`` to ``handle`` through an
  optimization barrier, so the work that consumes ``xs`` (or produced them) is
  ordered after the start (or before the done). XLA cannot see through the
  barrier, so the start, the GEMM and the done stay in program order."""
  if not comm.ordered:
    return handle, xs
  return lax.optimization_barrier((handle, xs))


# ---------------------------------------------------------------------------
# Checks and small helpers


def _in_shard_map(axis_name) -> bool:
  return jcore.get_axis_env().axis_exists(axis_name)


def _axis_size(axis_name) -> int:
  return jcore.get_axis_env().axis_size(axis_name)


def _check(api, x, w):
  for name, a in (("x", x), ("w", w)):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
      raise TypeError(f"{api}: {name} must be an array, got {type(a).__name__}")
    if a.ndim != 2:
      raise ValueError(f"{api}: {name} must have rank 2 (use jax.vmap for leading "
                       f"dimensions), got shape {tuple(a.shape)}")
  if x.dtype != w.dtype:
    raise TypeError(f"{api}: x and w must have one dtype, got {x.dtype} and {w.dtype}")
  if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
    raise TypeError(f"{api}: unsupported dtype {x.dtype}; supported: "
                    + ", ".join(str(d) for d in SUPPORTED_DTYPES))
  if x.shape[1] != w.shape[0]:
    raise ValueError(f"{api}: contraction mismatch, x {tuple(x.shape)} @ w {tuple(w.shape)}")


def _varying(x, axis):
  """Casts ``x`` to varying over ``axis`` (as jax.lax collectives do), so the
  custom VJPs below see one type; its transpose psums an invariant input's grad."""
  if not compat.check_vma_enabled() or axis in compat.varying(jax.typeof(x)):
    return x
  return compat.pvary(x, (axis,))


def _like(ct, primal):
  """A cotangent typed as its primal: summed over the mesh axes it varies over and the primal
  does not (the transpose of the implicit pvary of an input invariant over them, e.g. a weight
  replicated over the other axes of a 2-D mesh)."""
  extra = tuple(sorted(compat.varying(jax.typeof(ct)) - compat.varying(jax.typeof(primal)), key=str))
  if not extra:
    return ct
  comm = _comm()
  return comm.done(comm.psum_start(ct, extra))


def _dot(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _zeros_varying(shape, dtype, *like):
  """Zeros varying over the axes ``like`` vary over (a dynamic_update_slice target)."""
  z = jnp.zeros(shape, dtype)
  vma = set()
  for a in like:
    vma |= compat.varying(jax.typeof(a))
  return compat.pvary(z, tuple(sorted(vma, key=str))) if vma else z


# ---------------------------------------------------------------------------
# Per-shard schedules (no AD rules here; these are what partition() lowers to)


def _fused(kind, x, w, axis):
  """The fused GPU kernels (overlap_gpu: tile-wise signaling sm90 GEMM) when
  they apply to this per-shard op (GPU, bf16/f16, module built), else None."""
  from jax_dfccl._src import overlap_gpu  # noqa: PLC0415
  return overlap_gpu if overlap_gpu.applies(kind, x, w, _axis_size(axis)) else None


def _ag_matmul_shard(x, w, axis, *, gather_x=False):
  """Ring AG+GEMM. Returns (all_gather(x) @ w, all_gather(x) or None)."""
  if (fused := _fused("ag", x, w, axis)) is not None:
    return fused.all_gather_matmul(x, w, axis, _axis_size(axis), gather_x=gather_x)
  comm, n, r = _comm(), _axis_size(axis), lax.axis_index(axis)
  m = x.shape[0]
  to_left = [(i, (i - 1) % n) for i in range(n)]
  out = _zeros_varying((n * m, w.shape[1]), x.dtype, x, w)
  xg = _zeros_varying((n * m, x.shape[1]), x.dtype, x) if gather_x else None
  chunk, h = x, None
  for s in range(n):
    row = ((r + s) % n) * m                   # `chunk` holds the rows of rank r+s
    if s < n - 1:                             # forward it while we multiply it
      h = comm.ppermute_start(chunk, axis, to_left)
      h, (chunk,) = _pin(comm, h, chunk)
    out = lax.dynamic_update_slice_in_dim(out, _dot(chunk, w).astype(x.dtype), row, 0)
    if gather_x:
      xg = lax.dynamic_update_slice_in_dim(xg, chunk, row, 0)
    if s < n - 1:
      h, (out,) = _pin(comm, h, out)
      chunk = comm.done(h)
  return out, xg


def _matmul_rs_shard(x, w, axis):
  """Ring GEMM+RS, own block last with the received partial folded in."""
  if (fused := _fused("rs", x, w, axis)) is not None:
    return fused.matmul_reduce_scatter(x, w, axis, _axis_size(axis))
  comm, n, r = _comm(), _axis_size(axis), lax.axis_index(axis)
  mb = x.shape[0] // n
  to_right = [(i, (i + 1) % n) for i in range(n)]
  h = None
  for s in range(n):
    blk = (r - s - 1) % n                     # s = n-1: the rank's own block
    xb = lax.dynamic_slice_in_dim(x, blk * mb, mb, 0)
    if h is not None:
      h, (xb,) = _pin(comm, h, xb)
    part = _dot(xb, w)
    if h is not None:
      h, (part,) = _pin(comm, h, part)
      part = part + comm.done(h).astype(jnp.float32)
    if s < n - 1:
      h = comm.ppermute_start(part, axis, to_right)  # in float32: n-1 additions hop by hop
  return part.astype(x.dtype)


def _matmul_psum_shard(x, w, axis, num_chunks):
  """Row-chunked GEMM+AR: chunk c's psum overlaps chunk c+1's GEMM."""
  comm = _comm()
  bounds = np.linspace(0, x.shape[0], max(1, min(num_chunks, x.shape[0])) + 1).astype(int)
  outs, h = [], None
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    xc = x[lo:hi]
    if h is not None:
      h, (xc,) = _pin(comm, h, xc)
    part = _dot(xc, w).astype(x.dtype)
    if h is not None:
      h, (part,) = _pin(comm, h, part)
      outs.append(comm.done(h))
      if not comm.ordered:  # keep XLA from combining the chunks' all-reduces into one
        part, outs[-1] = lax.optimization_barrier((part, outs[-1]))
    h = comm.psum_start(part, axis)
  outs.append(comm.done(h))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)


# ---------------------------------------------------------------------------
# Per-shard ops with VJPs


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _agmm(x, w, axis):
  return _ag_matmul_shard(x, w, axis)[0]


def _agmm_fwd(x, w, axis):
  out, xg = _ag_matmul_shard(x, w, axis, gather_x=True)
  return out, (xg, w)


def _agmm_bwd(axis, res, g):
  xg, w = res
  dx = _matmul_rs_shard(g, w.T, axis)                  # GEMM+RS, overlapped
  dw = _dot(xg.T, g).astype(w.dtype)
  return dx, _like(dw, w)


_agmm.defvjp(_agmm_fwd, _agmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mmrs(x, w, axis):
  return _matmul_rs_shard(x, w, axis)


def _mmrs_fwd(x, w, axis):
  return _matmul_rs_shard(x, w, axis), (x, w)


def _mmrs_bwd(axis, res, g):
  x, w = res
  dx, gg = _ag_matmul_shard(g, w.T, axis, gather_x=True)  # AG+GEMM, overlapped
  dw = _dot(x.T, gg).astype(w.dtype)
  return _like(dx, x), _like(dw, w)


_mmrs.defvjp(_mmrs_fwd, _mmrs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mmar(x, w, axis, num_chunks):
  return _matmul_psum_shard(x, w, axis, num_chunks)


def _mmar_fwd(x, w, axis, num_chunks):
  return _matmul_psum_shard(x, w, axis, num_chunks), (x, w)


def _mmar_bwd(axis, num_chunks, res, g):
  del num_chunks
  x, w = res
  if not compat.check_vma_enabled():
    # As jax.lax.psum's transpose without check_vma: every rank's copy of the result reached the
    # loss, so the cotangent is their sum.  (With check_vma, g is invariant: no communication.)
    comm = _comm()
    g = comm.done(comm.psum_start(g, axis))
  return _like(_dot(g, w.T).astype(x.dtype), x), _like(_dot(x.T, g).astype(w.dtype), w)


_mmar.defvjp(_mmar_fwd, _mmar_bwd)


# ---------------------------------------------------------------------------
# Global-array form: custom_partitioning with Shardy rules

# (x spec, w spec, result spec) over mesh axis `a`, per op.
_SPECS = {
    "ag": lambda a: (P(a, None), P(None, a), P(None, a)),
    "rs": lambda a: (P(None, a), P(a, None), P(a, None)),
    "ar": lambda a: (P(None, a), P(a, None), P(None, None)),
}
_LOWER = {
    "ag": lambda x, w, a: _ag_matmul_shard(x, w, a)[0],
    "rs": _matmul_rs_shard,
    "ar": lambda x, w, a: _matmul_psum_shard(x, w, a, DEFAULT_PSUM_CHUNKS),
}


_EMPTY_MESH = jax.sharding.AbstractMesh((), ())


def _make_partitioned(kind):
  @functools.partial(custom_partitioning, static_argnums=(2,))
  def op(x, w, axis):
    return _dot(x, w).astype(x.dtype)

  def partition(axis, mesh, arg_shapes, result_shape):
    del arg_shapes, result_shape  # we impose the Megatron shardings; XLA reshards
    xs, ws, outs = _SPECS[kind](axis)

    def lower(x, w):
      # Per-shard code: no context mesh (an ambient jax.set_mesh would leave
      # sharding annotations in the partitioned module).
      with jax.sharding.use_abstract_mesh(_EMPTY_MESH):
        return _LOWER[kind](_varying(x, axis), _varying(w, axis), axis)

    return (mesh, lower, NamedSharding(mesh, outs),
            (NamedSharding(mesh, xs), NamedSharding(mesh, ws)))

  def infer(axis, mesh, arg_shapes, result_shape):  # GSPMD only (Shardy uses the rule)
    del arg_shapes, result_shape
    return NamedSharding(mesh, _SPECS[kind](axis)[2])

  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule="m k, k n -> m n")
  return op


_PARTITIONED = {k: _make_partitioned(k) for k in _SPECS}


def _mesh_of(api, axis, *arrays):
  for a in arrays:
    m = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    if m is not None and not m.empty and axis in m.axis_names:
      return m
  m = jax.sharding.get_abstract_mesh()
  if not m.empty and axis in m.axis_names:
    return m
  raise NameError(f"{api}: {axis!r} is neither a shard_map axis nor an axis of the "
                  f"inputs' mesh (shard the inputs with a NamedSharding or use jax.set_mesh)")


def _on_mesh(mesh, fn, out_spec, *args):
  """Runs ``fn`` with every axis in Auto mode (custom_partitioning and
  sharding propagation need that) and constrains its result to ``out_spec``."""
  from jax.sharding import AxisType  # noqa: PLC0415
  with jax.sharding.use_abstract_mesh(mesh):
    if any(t == AxisType.Explicit for t in mesh.axis_types):
      return jax.sharding.auto_axes(fn, out_sharding=out_spec)(*args)
    return lax.with_sharding_constraint(fn(*args), out_spec)


def _global_call(kind, mesh, x, w, axis):
  return _on_mesh(mesh, lambda x, w: _PARTITIONED[kind](x, w, axis), _SPECS[kind](axis)[2], x, w)


def _global_dot(mesh, a, b, out_spec):
  return _on_mesh(mesh, lambda a, b: _dot(a, b).astype(a.dtype), out_spec, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 4))
def _global(kind, mesh, x, w, axis):
  return _global_call(kind, mesh, x, w, axis)


def _global_fwd(kind, mesh, x, w, axis):
  return _global_call(kind, mesh, x, w, axis), (x, w)


def _global_bwd(kind, mesh, axis, res, g):
  x, w = res
  xs, ws, _ = _SPECS[kind](axis)
  wt = w.T
  if kind == "ag":      # g cols-sharded: dx = g @ w.T is a GEMM+RS
    dx = _global_call("rs", mesh, g, wt, axis)
  elif kind == "rs":    # g rows-sharded: dx = g @ w.T is an AG+GEMM
    dx = _global_call("ag", mesh, g, wt, axis)
  else:                 # g replicated: local GEMM
    dx = _global_dot(mesh, g, wt, xs)
  return dx, _global_dot(mesh, x.T, g, ws)


_global.defvjp(_global_fwd, _global_bwd)


def _lax_composition(kind, x, w, axis_name):
  """What the per-shard ops replace, with jax.lax's collectives (and their numerics)."""
  if kind == "ag":
    return _dot(lax.all_gather(x, axis_name, axis=0, tiled=True), w).astype(x.dtype)
  if kind == "rs":
    return lax.psum_scatter(_dot(x, w), axis_name, scatter_dimension=0, tiled=True).astype(x.dtype)
  return lax.psum(_dot(x, w).astype(x.dtype), axis_name)


def _dispatch(api, kind, x, w, axis_name, per_shard):
  if isinstance(axis_name, (tuple, list)):
    if len(axis_name) != 1:
      raise NotImplementedError(f"{api}: exactly one mesh axis is supported, got {axis_name!r}")
    axis_name = axis_name[0]
  x, w = jnp.asarray(x), jnp.asarray(w)
  _check(api, x, w)
  from jax_dfccl._src.frontend import vmapped_axes
  if vmapped_axes(axis_name):  # an axis of jax.vmap: no device communicates, jax.lax's composition
    return _lax_composition(kind, x, w, axis_name)
  if _in_shard_map(axis_name):
    n = _axis_size(axis_name)
    if kind == "rs" and x.shape[0] % n:
      raise ValueError(f"{api}: x has {x.shape[0]} rows, not divisible by the "
                       f"{n} ranks of axis {axis_name!r}")
    return per_shard(_varying(x, axis_name), _varying(w, axis_name), axis_name)
  mesh = _mesh_of(api, axis_name, x, w)
  n = mesh.shape[axis_name]
  dims = {"ag": [("x rows", x.shape[0]), ("w columns", w.shape[1])],
          "rs": [("x rows", x.shape[0]), ("x columns", x.shape[1])],
          "ar": [("x columns", x.shape[1])]}[kind]
  for what, d in dims:
    if d % n:
      raise ValueError(f"{api}: {what} ({d}) not divisible by the {n} devices of mesh axis "
                       f"{axis_name!r}")
  return _global(kind, mesh, x, w, axis_name)


# ---------------------------------------------------------------------------
# Public API


_COMMON_ARGS = """x: the left operand, rank 2 (bfloat16, float16 or float32; ``jax.vmap`` for
      leading dimensions).
    w: the right operand, rank 2, ``x``'s dtype.
    axis_name: one mesh axis: a ``jax.shard_map`` axis (per-shard form) or an axis of the
      inputs' mesh (global form, under plain ``jax.jit``)."""
_COMMON_RAISES = """TypeError: ``x`` or ``w`` not an array, dtypes that differ or are not supported.
    ValueError: operands not of rank 2, a contraction mismatch, or sizes not divisible by the
      axis size where the form needs it.
    NameError: ``axis_name`` neither a shard_map axis nor an axis of the inputs' mesh.
    NotImplementedError: ``axis_name`` naming more than one axis."""
_EXAMPLE = """    >>> mesh = jax.sharding.Mesh(jax.devices(), ("x",))
    >>> x = jnp.arange(128.0).reshape(16, 8) % 7
    >>> w = jnp.arange(128.0).reshape(8, 16) % 5
    >>> f = jax.jit(jax.shard_map(lambda a, b: {call}, mesh=mesh,
    ...                           in_specs=({xs}, {ws}), out_specs={os}))
    >>> print(np.allclose(f(x, w), x @ w))
    True
"""


def all_gather_matmul(x, w, axis_name):
  return _dispatch("all_gather_matmul", "ag", x, w, axis_name, _agmm)


def matmul_reduce_scatter(x, w, axis_name):
  return _dispatch("matmul_reduce_scatter", "rs", x, w, axis_name, _mmrs)


def matmul_psum(x, w, axis_name, *, num_chunks: int = DEFAULT_PSUM_CHUNKS):
  if not isinstance(num_chunks, int) or num_chunks < 1:
    raise ValueError(f"matmul_psum: num_chunks must be a positive int, got {num_chunks!r}")
  return _dispatch("matmul_psum", "ar", x, w, axis_name,
                   lambda x, w, a: _mmar(x, w, a, num_chunks))


all_gather_matmul.__doc__ = f"""``all_gather(x, axis_name, axis=0, tiled=True) @ w``, the gather hidden behind the GEMM.

  A ring over the axis: each step multiplies the block of rows received last while the
  next one travels (see the module docstring for the schedule and both calling
  conventions).  Differentiable (reverse mode): the gradient with respect to ``x`` is a
  :func:`matmul_reduce_scatter`, with the same overlap.

  Args:
    {_COMMON_ARGS}

  Returns:
    Per shard: ``x`` ``[m, K]`` (this rank's rows) and ``w`` ``[K, n]`` give ``[P*m, n]``
    (``P`` the axis size).  Global: ``x`` ``[M, K]`` sharded by rows and ``w`` ``[K, N]``
    by columns give ``x @ w`` sharded by columns.  In ``x``'s dtype (accumulated in float32).

  Raises:
    {_COMMON_RAISES}

  Example:
{_EXAMPLE.format(call='jax_dfccl.all_gather_matmul(a, b, "x")', xs='P("x")', ws='P(None, "x")',
                 os='P(None, "x")')}
  """
matmul_reduce_scatter.__doc__ = f"""``psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)``, overlapped and tail-free.

  Each step computes the row block of one rank, adds the partial sum received and sends it
  on, so no communication follows the last GEMM.  Differentiable (reverse mode): the
  gradient with respect to ``x`` is an :func:`all_gather_matmul`.

  Args:
    {_COMMON_ARGS}

  Returns:
    Per shard: ``x`` ``[M, k]`` and ``w`` ``[k, N]`` give this rank's ``[M/P, N]`` block of
    the sum (``M`` divisible by the axis size ``P``).  Global: ``x`` ``[M, K]`` sharded by
    columns and ``w`` ``[K, N]`` by rows give ``x @ w`` sharded by rows.

  Raises:
    {_COMMON_RAISES}

  Example:
{_EXAMPLE.format(call='jax_dfccl.matmul_reduce_scatter(a, b, "x")', xs='P(None, "x")', ws='P("x")',
                 os='P("x")')}
  """
matmul_psum.__doc__ = f"""``psum(x @ w, axis_name)`` with the all-reduce of each chunk of rows behind the next GEMM.

  The rows are cut into ``num_chunks`` chunks; the last chunk's all-reduce is the tail.

  Args:
    {_COMMON_ARGS}
    num_chunks: the number of row chunks (a positive int).

  Returns:
    Per shard: ``x`` ``[M, k]`` and ``w`` ``[k, N]`` give ``[M, N]``, the same on every rank.
    Global: ``x`` ``[M, K]`` sharded by columns and ``w`` ``[K, N]`` by rows give ``x @ w``
    replicated.

  Raises:
    {_COMMON_RAISES}  A ``num_chunks`` that is not a positive int is a ValueError.

  Example:
{_EXAMPLE.format(call='jax_dfccl.matmul_psum(a, b, "x")', xs='P(None, "x")', ws='P("x")', os='P()')}
  """
