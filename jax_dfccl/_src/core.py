"""The start/done primitives every collective is built on.

Each op module (psum.py, all_gather.py, ...) describes its canonical form with
an :class:`OpDef` (abstract eval, transpose, batching) and a *plan* function
that brings user arguments into that form.  This module owns the three
primitives and their rules:

* ``dfccl_collective`` — the blocking form; lowers to one ``dfccl_collective``
  custom call on CUDA, to ``dfccl_start`` followed by ``dfccl_done`` on CPU
  (custom calls, see ``xla_ffi/ffi/attrs.h``); linear, with JVP/transpose/batching
  delegated to the op.
* ``dfccl_start`` — returns ``(out, input_alias, ticket)``; ``input_alias``
  keeps the input alive until the matching done (GPU; the CPU runtime copies
  the input at the start, and there it is not aliased to the input).
* ``dfccl_done`` — waits for the instance and returns ``out``.

Identity, not order: every instance is identified by ``(group, key, seq)``.
``key`` is the user's key or is derived from op, shape, dtype, axes and the
call site; the runtime counts ``seq`` per key on each rank.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src import effects
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax._src.sharding_impls import SPMDAxisContext

from jax_dfccl._src import compat
from jax_dfccl._src import order
from jax_dfccl._src.keys import derive

# --------------------------------------------------------------------------
# Effect: keeps collectives from being dead-code eliminated or hoisted, and is
# allowed everywhere JAX's own collectives are (control flow, remat, custom AD).


class DfcclEffect(effects.Effect):
  __str__ = lambda self: "DfcclCollective"


dfccl_effect = DfcclEffect()
for _s in (effects.lowerable_effects, effects.control_flow_allowed_effects,
           effects.remat_allowed_effects, effects.custom_derivatives_allowed_effects):
  _s.add_type(DfcclEffect)

# --------------------------------------------------------------------------
# Op registry

# The op kinds, reduce ops and the runtimes' dtypes are defined once, in the C++
# op table (xla_ffi/include/dfccl/ops.h, collective.h); the extension modules
# export it (`op_table()`), and these names read it on first use:
#   KIND              op kind name -> the `kind` attribute of the custom calls
#   REDUCE            reduce op name -> the `reduce_op` attribute
#   SUPPORTED_DTYPES  the dtypes the runtimes compute on


@functools.cache
def _tables() -> dict:
  from jax_dfccl._src import backend
  t = backend.op_table()
  return dict(KIND={k: v[0] for k, v in t["ops"].items()}, REDUCES={k: v[1] for k, v in t["ops"].items()},
              REDUCE=dict(t["reduces"]),
              SUPPORTED_DTYPES=tuple(np.dtype(jnp.bfloat16) if n == "bfloat16" else np.dtype(n)
                                     for n in t["dtypes"]))


def reduces(op: str) -> bool:
  """Whether op module `op`'s collective combines values (the op table's `reduces`)."""
  return _tables()["REDUCES"][OPS[op].kind]


def __getattr__(name):
  if name in ("KIND", "REDUCE", "SUPPORTED_DTYPES"):
    return _tables()[name]
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class OpDef:
  """The canonical form of one collective (see xla_ffi/include/dfccl/collective.h).

  abstract(aval, n, params, *init_avals) -> output aval
  transpose(ct, params) -> cotangent of the input (built from blocking binds)
  batch(x, bdim) -> (x with the batch dim where the op allows it, output bdim)
  jvp(x, t, params) -> (y, t_out), or None for linear ops

  ``split`` says how a blocking collective whose rank's input is larger than one
  collective may carry (a group spanning hosts: a receive slot's section) is run
  as several, each on a piece of every rank's input (``lowering_plans``):
  ``"elementwise"`` (pieces of the flat input, outputs joined flat), ``"gather"``
  (pieces of the flat input, outputs ``(n, piece)`` joined along axis 1),
  ``"blocks"`` (input ``(n, m)`` cut along m, outputs ``(n, piece)`` joined along
  axis 1), ``"blocks_reduce"`` (input ``(n, m)`` cut along m, outputs joined
  flat); ``""``: never split (the collective is refused above the limit).

  ``kind`` names the op's row of the C++ op table.  An op whose result starts
  from the caller's values (ragged_all_to_all) binds them as a second operand,
  ``init``, aliased to the output (no JVP/transpose/batching through the
  primitives then: its public function defines its derivatives).
  """
  name: str
  kind: str
  abstract: Callable
  transpose: Callable
  batch: Callable
  jvp: Callable | None = None
  split: str = ""


OPS: dict[str, OpDef] = {}


def register_op(op: OpDef) -> OpDef:
  OPS[op.name] = op
  return op


# --------------------------------------------------------------------------
# Trace-time checks


def as_axes(axis_name) -> tuple:
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not axes:
    raise ValueError("jax_dfccl: axis_name must name at least one mesh axis")
  if len(set(axes)) != len(axes):
    raise ValueError(f"jax_dfccl: repeated axis in axis_name {axis_name!r}")
  return axes


def group_size(axes: tuple, api: str) -> int:
  env = core.get_axis_env()
  n = 1
  for a in axes:
    if not env.axis_exists(a):  # jax.lax's wording (code and tests match it)
      raise NameError(f"jax_dfccl.{api}: Found an unbound axis name: {a}. To fix this, please "
                      f"call {api} under `jax.shard_map` over a mesh that has axis {a!r}.")
    n *= env.axis_size(a)
  return n


def make_varying(x, axes):
  """Like jax.lax collectives: an input invariant over `axes` is first made
  varying (so psum of an invariant value multiplies it by the group size)."""
  if not compat.check_vma_enabled():
    return x
  aval = jax.typeof(x)
  if compat.unreduced(aval) & set(axes) or compat.reduced(aval) & set(axes):
    return x  # unreduced/reduced inputs keep their type (the op's abstract eval decides)
  missing = tuple(a for a in axes if a not in compat.varying(aval))
  return compat.pvary(x, missing) if missing else x


# --------------------------------------------------------------------------
# Primitives

collective_p = core.Primitive("dfccl_collective")
start_p = core.Primitive("dfccl_start")
start_p.multiple_results = True
done_p = core.Primitive("dfccl_done")

_SITES = itertools.count(1)


def _out_aval(aval, params, *init):
  groups = params["groups"]
  n = len(groups[0]) if groups else group_size(params["axes"], params["op"])
  return OPS[params["op"]].abstract(aval, n, params, *init)


def _effects(params):
  return {dfccl_effect, *map(core.NamedAxisEffect, params["axes"])}


def _collective_abstract(aval, *init, **params):
  return _out_aval(aval, params, *init), _effects(params)


def _ticket_aval(aval):
  return compat.with_shape_vma(aval, (), compat.varying(aval)).update(dtype=np.dtype(np.int64),
                                                                      weak_type=False)


def _start_abstract(aval, *init, site, **params):
  return [_out_aval(aval, params, *init), aval, _ticket_aval(aval)], _effects(params)


def _done_abstract(out, x_alias, ticket, *, key, site, route=None):
  return out, {dfccl_effect}


collective_p.def_effectful_abstract_eval(_collective_abstract)
start_p.def_effectful_abstract_eval(_start_abstract)
done_p.def_effectful_abstract_eval(_done_abstract)


def _no_impl(*args, **params):
  raise ValueError("jax_dfccl collectives must be called inside jax.shard_map "
                   "(under jax.jit), like jax.lax collectives")


for _p in (collective_p, start_p, done_p):
  _p.def_impl(_no_impl)

# ---- AD (blocking form only: start/done handles are not differentiable) ----


def _collective_jvp(primals, tangents, **params):
  if len(primals) > 1:
    raise NotImplementedError(f"jax_dfccl: forward-mode differentiation of {params['op']} is not supported")
  (x,), (t,) = primals, tangents
  op = OPS[params["op"]]
  if op.jvp is not None:
    return op.jvp(x, t, params)
  y = collective_p.bind(x, **params)
  if type(t) is ad.Zero:
    return y, ad.Zero(core.get_aval(y).to_tangent_aval())
  return y, collective_p.bind(t, **derive(params, "jvp"))


def _collective_transpose(ct, x, *init, **params):
  if init:
    raise NotImplementedError(f"jax_dfccl: {params['op']} is differentiated by its public function only")
  if type(ct) is ad.Zero:
    return [ad.Zero(x.aval)]
  return [OPS[params["op"]].transpose(ct, derive(params, "T"))]


ad.primitive_jvps[collective_p] = _collective_jvp
ad.primitive_transposes[collective_p] = _collective_transpose

# ---- remat ----
# JAX saves the outputs of every effectful equation under jax.checkpoint; our
# effect is there to keep a collective whose result one branch discards (order-free
# programs), not to make it unrecomputable.  So, as jax.lax's collectives: recomputed
# unless the policy saves it.  A policy is asked about jax.lax's primitive of the
# same op as well, so policies that name jax.lax collectives keep their meaning.

_LAX_PRIM = {"psum": "psum_invariant_p", "all_gather": "all_gather_p", "psum_scatter": "reduce_scatter_p",
             "all_to_all": "all_to_all_p", "ppermute": "ppermute_p"}


def _policy(saveable, eqn):
  from jax._src.interpreters import partial_eval as pe
  from jax._src.lax import parallel
  avals = [v.aval for v in eqn.invars]
  cases = [pe.ensure_enum(saveable(eqn.primitive, *avals, **eqn.params))]
  lax_prim = getattr(parallel, _LAX_PRIM.get(eqn.params["op"], ""), None)
  if lax_prim is not None:
    if eqn.params["op"] == "psum" and eqn.params["reduce"] != "sum":
      lax_prim = parallel.pmax_p if eqn.params["reduce"] == "max" else parallel.pmin_p
    try:
      cases.append(pe.ensure_enum(saveable(lax_prim, *avals, axes=eqn.params["axes"],
                                           axis_name=eqn.params["axes"])))
    except (KeyError, TypeError, AttributeError):  # a policy reading params of jax.lax's own
      pass
  return "recompute" if all(isinstance(cs, pe.RecomputeType) for cs in cases) else "save"


def _collective_pe_custom(saveable, unks_in, inst_in, eqn):
  from jax._src.core import Var
  res = [v for v, inst in zip(eqn.invars, inst_in) if type(v) is Var and not inst]
  if any(unks_in):
    return None, eqn, [True], [True], res
  if _policy(saveable, eqn) == "save":
    return eqn, None, [False], [False], []
  return eqn, eqn, [False], [True], res  # run forward, and again where the backward needs it


def _register_remat():
  from jax._src.interpreters import partial_eval as pe
  pe.partial_eval_jaxpr_custom_rules[collective_p] = _collective_pe_custom


_register_remat()


def _no_ad(*args, **kw):
  raise NotImplementedError("jax_dfccl: start/done handles are not differentiable; "
                            "use the blocking form (e.g. jax_dfccl.psum) under autodiff")


ad.primitive_jvps[start_p] = _no_ad
ad.primitive_jvps[done_p] = _no_ad

# ---- batching ----


def _check_not_batched_axis(axis_data, params):
  if axis_data.name is not None and axis_data.name in params["axes"]:
    raise NotImplementedError("jax_dfccl: collectives over a vmapped axis name are not supported")


def _check_no_init(vals_in, params):
  if len(vals_in) > 1:
    raise NotImplementedError(f"jax_dfccl: vmap of {params['op']} is not supported")


def _collective_batch(axis_data, vals_in, dims_in, **params):
  _check_not_batched_axis(axis_data, params)
  if all(d is None for d in dims_in):
    return collective_p.bind(*vals_in, **params), None
  _check_no_init(vals_in, params)
  (x,), (d,) = vals_in, dims_in
  x, out_d = OPS[params["op"]].batch(x, d)
  return collective_p.bind(x, **params), out_d


def _start_batch(axis_data, vals_in, dims_in, **params):
  _check_not_batched_axis(axis_data, params)
  if all(d is None for d in dims_in):
    return start_p.bind(*vals_in, **params), [None, None, None]
  _check_no_init(vals_in, params)
  (x,), (d,) = vals_in, dims_in
  x, out_d = OPS[params["op"]].batch(x, d)
  out, xa, t = start_p.bind(x, **params)
  # The ticket is per device, not per batch element: broadcast it.
  return [out, xa, t], [out_d, d, None]


def _done_batch(axis_data, vals_in, dims_in, **params):
  (out, xa, t), (d_out, d_xa, d_t) = vals_in, dims_in
  if d_t is not None:
    raise NotImplementedError("jax_dfccl: vmapping over a batch of handles is not supported")
  return done_p.bind(out, xa, t, **params), d_out


batching.fancy_primitive_batchers[collective_p] = _collective_batch
batching.fancy_primitive_batchers[start_p] = _start_batch
batching.fancy_primitive_batchers[done_p] = _done_batch

# ---- lowering ----


def _partially_manual(ctx) -> bool:
  """Inside ``jax.shard_map(..., axis_names=...)`` that leaves some mesh axes
  (of size > 1) to XLA's partitioner."""
  ac = ctx.module_context.axis_context
  if not isinstance(ac, SPMDAxisContext) or not ac.manual_axes:
    return False
  mesh = ac.mesh
  return bool({a for a in mesh.axis_names if mesh.shape[a] > 1} - set(ac.manual_axes))


def _spmd_mesh(ctx, api):
  ac = ctx.module_context.axis_context
  if not isinstance(ac, SPMDAxisContext):
    raise ValueError(f"jax_dfccl.{api}: must be lowered inside jax.shard_map")
  if _partially_manual(ctx):
    raise NotImplementedError(
        f"jax_dfccl.{api}: inside a partially-manual shard_map (axis_names=...) only the "
        "blocking collectives are supported, not the start/done forms (nor the overlap ops "
        "built on them); use the blocking form there, or make every mesh axis manual")
  return ac.mesh


def _lower_fully_manual(ctx, x, params, *init):
  """A blocking collective in a partially-manual region, as jax.lax.axis_index does
  it: inside a nested shard_map over the remaining (automatic) axes.  Its input is
  replicated over them there (XLA gathers it if it was sharded), so each group of
  the manual axes — the devices that share their automatic coordinates — runs the
  collective on the whole value, and the result is the same for every automatic
  coordinate, as the nested shard_map's out_specs=P() declares.  Inside it every
  axis is manual, so hlo.partition_id is the device's position in the full mesh,
  as group_table (built over the full mesh) expects."""
  from jax._src.shard_map import shard_map
  from jax.sharding import PartitionSpec

  def spec(aval):  # Explicit automatic axes keep their sharding (e.g. a vmapped dim over one)
    sp = getattr(getattr(aval, "sharding", None), "spec", None)
    return PartitionSpec(*sp) if sp is not None and any(e is not None for e in sp) else PartitionSpec()

  def f(v, *w):
    return shard_map(lambda u, *i: collective_p.bind(u, *i, **params), check_vma=False,
                     in_specs=(spec(ctx.avals_in[0]), *map(spec, ctx.avals_in[1:])),
                     out_specs=spec(ctx.avals_out[0]))(v, *w)
  return mlir.lower_fun(f, multiple_results=False)(ctx, x, *init)


def group_table(mesh, axes, groups=None) -> np.ndarray:
  """(num_groups, group_size) partition ids; a row is a group in rank order
  (row-major over `axes` in the order given, as jax.lax.axis_index); with
  `groups` (axis_index_groups) every such row is split into those groups."""
  names = list(mesh.axis_names)
  sizes = [mesh.shape[a] for a in names]
  strides = {a: int(np.prod(sizes[i + 1:])) for i, a in enumerate(names)}
  others = [a for a in names if a not in axes]
  rows = []
  for oc in itertools.product(*[range(mesh.shape[a]) for a in others]):
    base = sum(c * strides[a] for a, c in zip(others, oc))
    rows.append([base + sum(c * strides[a] for a, c in zip(axes, ac))
                 for ac in itertools.product(*[range(mesh.shape[a]) for a in axes])])
  if groups:
    rows = [[row[i] for i in g] for row in rows for g in groups]
  return np.asarray(rows, dtype=np.int32)


def device_ids(mesh) -> np.ndarray:
  """Per flat mesh position, the device as the runtimes see it: the local hardware
  id (the CUDA ordinal an FFI handler is called with); on CPU the global ``id``
  (unique across processes, which the runtime spanning processes needs)."""
  if isinstance(mesh, jax.sharding.Mesh):
    # GPUs in one process: the CUDA ordinal; across processes the global id (the
    # runtime maps its own GPUs' ids to ordinals, jax_dfccl.initialize()).
    multi = jax.process_count() > 1
    hw = lambda d: d.local_hardware_id if d.platform != "cpu" and not multi and getattr(d, "local_hardware_id", None) is not None else d.id  # noqa: E731
    return np.asarray([hw(d) for d in mesh.devices.flat], dtype=np.int64)
  return np.arange(mesh.size, dtype=np.int64)  # abstract mesh: partition ids


def _partition_id_operand(ctx):
  """The calls' partition-id operand.  The CPU handlers read it.  The CUDA handlers
  cannot (it lives in device memory when the call is enqueued) and find the rank
  from the GPU they run on (`PartitionOf`), so a program lowered for CUDA alone
  passes a constant: XLA computes a partition id with a memset and a convert
  kernel, outside its command buffers, once per execution and again in every
  iteration of a while loop."""
  if tuple(getattr(ctx.module_context, "platforms", ())) == ("cuda",):
    return mlir.ir_constant(np.array(0, np.int32))
  pid = hlo.partition_id()
  return hlo.convert(ir.RankedTensorType.get([], ir.IntegerType.get_signless(32)), pid)


_PID_AVAL = core.ShapedArray((), np.int32)
_TICKET = core.ShapedArray((), np.int64)


class CallSite(int):
  """A start's call-site id (its ``site`` parameter) that also says whether its handle reached a
  ``done``: ``done`` sets it while the program is traced, the start's lowering reads it, so the
  state lives with the traced program, not in the process.  A start whose handle never reaches a
  done is refused when the program is lowered: its instance would run on every rank with its
  result dropped, and on CPU its staging would stay until ``reset()``."""
  done = False


def _async_start_lowering(ctx, x, *init, site, **params):
  from jax_dfccl._src import lowering_plans
  lowering_plans.check_start(ctx, params, init)
  if not getattr(site, "done", True):
    raise ValueError(f"jax_dfccl: the handle of {params['op']} start {params['key']!r} is never "
                     "passed to jax_dfccl.done in this program; every *_start needs exactly one "
                     "done in the same jitted program")
  return _start_lowering(ctx, x, *init, site=site, **params)


def _copy_engine_path(ctx, op, nranks, x_aval, out_aval) -> bool:
  """Whether this CUDA collective takes the copy-engine path: the runtime's rule
  (``uses_copy_engine``, from ``copy_engine_min_bytes`` and friends, which are
  therefore read when the program is lowered)."""
  if "cuda" not in getattr(ctx.module_context, "platforms", ()):
    return False
  from jax_dfccl._src import backend
  cuda = backend.runtimes().get("cuda")
  if cuda is None:
    return False
  nbytes = lambda a: int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize  # noqa: E731
  return bool(cuda.uses_copy_engine(int(_tables()['KIND'][OPS[op].kind]), int(nranks),
                                    nbytes(x_aval), nbytes(out_aval)))


def _route(ctx, op, nranks, x_aval, out_aval, start_form) -> str:
  """How a start and its done are lowered, decided from the same inputs by both (the done gets
  its start's ``op``, ``axes`` and ``groups`` as its ``route`` parameter), so lowering keeps no
  state between them: ``"trivial"`` (a group of one rank: plain HLO, see `_trivial`), ``"host"``
  (CUDA, the copy-engine path of the blocking form: the ``*_host`` target, host matching, no
  command buffers) or ``"runtime"`` (every other collective; on CUDA the daemon path, capturable
  into command buffers).  A start form (``start_form``: a ``dfccl_start`` with its done) always
  takes the daemon path, whose start forms work on their call site's own slots
  (docs/design/gpu.md, "Start forms are staged"): the copy-engine path moves XLA's buffers in
  place, which a program stopped between its start and its done has given back."""
  from jax_dfccl.config import config
  if nranks == 1 and not config.testing.runtime_for_groups_of_one:
    return "trivial"
  if start_form:
    return "runtime"
  return "host" if _copy_engine_path(ctx, op, nranks, x_aval, out_aval) else "runtime"


def route_of(params) -> tuple:
  """The ``route`` parameter a done gets from its start's parameters."""
  return (params["op"], params["axes"], params["groups"])


def _trivial(ctx, x, op, perm):
  """A collective over a group of one rank, as plain HLO (what XLA makes of
  jax.lax's): every op's canonical output holds the input's elements in its
  own shape (reduce / gather / scatter / exchange of one rank), except a
  ppermute in which the rank sends itself nothing: zeros.  (ragged_all_to_all
  over one rank never gets here: its plan places the rank's slices itself.)"""
  out_aval = ctx.avals_out[0]
  if op == "ppermute" and not perm:
    return mlir.full_like_aval(ctx, 0, out_aval)
  return mlir.reshape(ctx, x, out_aval)


def _spans_processes(ctx, mesh) -> bool:
  """Whether a program lowered for CUDA alone runs on devices of several processes."""
  if tuple(getattr(ctx.module_context, "platforms", ())) != ("cuda",) or not isinstance(mesh, jax.sharding.Mesh):
    return False
  return len({d.process_index for d in mesh.devices.flat}) > 1


def _start_lowering(ctx, x, *init, op, axes, groups, key, key_hash, reduce, perm, site,
                    target="dfccl_start", aliases=None, mode="varying"):
  del mode  # the manual-axis types of input and output (abstract eval and AD only)
  order.forget_finished_traces()  # the program is traced: its order holds its values no longer
  mesh = _spmd_mesh(ctx, op)
  if isinstance(mesh, jax.sharding.Mesh):
    from jax_dfccl._src import distributed
    distributed.check_reach(mesh.devices.flat, op)
  groups = group_table(mesh, axes, groups)
  route = _route(ctx, op, groups.shape[1], ctx.avals_in[0], ctx.avals_out[0], target == "dfccl_start")
  from jax_dfccl._src import distributed
  distributed.prepare_gpu_rows(ctx, mesh, device_ids(mesh), groups, key=key, aval=ctx.avals_in[0])
  if route == "trivial":  # nothing to match or move: no runtime
    out = _trivial(ctx, x, op, perm)
    if target == "dfccl_collective":
      return [out]
    return [out, x, mlir.ir_constant(np.array(0, np.int64))]
  from jax_dfccl._src import backend
  backend.load()  # registers the FFI targets before XLA compiles the call
  perm_arr = np.asarray(perm if perm else [(-1, -1)], dtype=np.int32).reshape(-1)
  if aliases is None and tuple(getattr(ctx.module_context, "platforms", ())) == ("cpu",):
    # The CPU runtime copies x before the start returns (xla_ffi/cpu/runtime.h, Task): x_alias
    # keeps nothing alive there, and aliasing it to x would make XLA copy an x that is used
    # after the start.
    aliases = {}
  aliases = dict({0: 1} if aliases is None else aliases)
  if init:  # operand 2 (after x and the partition id) is the output's initial value
    aliases[2] = 0
  if route == "host":
    target += "_host"
  elif _spans_processes(ctx, mesh):
    # The same handlers with XLA's initialize stage, which books every execution of the program
    # for the execution identity across processes (docs/design/execution_identity.md, "GPUs").
    target += "_x"
  rule = jax.ffi.ffi_lowering(target, operand_output_aliases=aliases, has_side_effect=True)
  sub = ctx.replace(avals_in=[ctx.avals_in[0], _PID_AVAL, *ctx.avals_in[1:]])
  return rule(sub, x, _partition_id_operand(ctx), *init,
              kind=np.int32(_tables()['KIND'][OPS[op].kind]), reduce_op=np.int32(_tables()['REDUCE'][reduce]),
              key=key, key_hash=np.int64(key_hash), site=np.int64(site),
              group_size=np.int32(groups.shape[1]), groups=groups.reshape(-1),
              device_ids=device_ids(mesh), perm=perm_arr)


def _done_lowering(ctx, out, x_alias, ticket, *, key, site, route=None, in_place=False):
  """The done of a start: waits for the instance, then returns its result.

  Both runtimes write their own memory until done (the GPU's start forms a slot of
  their call site, which the done kernel copies into done's result; the CPU's staging),
  and the start's output buffer must not be read before done either: XLA copies a buffer an instruction updates
  in place when the value has another user (a handle passed through
  `optimization_barrier`, returned, kept), and such a copy would read the
  transfer before it landed while the original buffer, dead to XLA, could be
  reused under the runtime's writes.  So done reads its operand and produces a
  result of its own (the handlers copy after the wait); only the blocking
  form's internal handle, whose one user is its done, is updated in place.
  """
  path = "runtime"
  if route is not None:  # its start's op, axes and groups
    op, axes, groups = route
    nranks = group_table(_spmd_mesh(ctx, op), axes, groups).shape[1]
    path = _route(ctx, op, nranks, ctx.avals_in[1], ctx.avals_in[0], True)  # (a done's start is a dfccl_start)
  if path == "trivial":  # its start had a group of one
    return [out]
  rule = jax.ffi.ffi_lowering("dfccl_done", operand_output_aliases={0: 0} if in_place else None,
                              has_side_effect=True)
  return rule(ctx, out, x_alias, ticket, key=key, site=np.int64(site))


def _collective_lowering(ctx, x, *init, **params):
  if _partially_manual(ctx):
    return _lower_fully_manual(ctx, x, params, *init)
  from jax_dfccl._src import lowering_plans  # (one collective lowered as several, where it must)
  if (several := lowering_plans.lower(ctx, x, params, init)) is not None:
    return several
  site = next(_SITES)
  x_aval, (out_aval,) = ctx.avals_in[0], ctx.avals_out
  t_aval = _TICKET
  out, xa, t = _start_lowering(ctx.replace(avals_out=[out_aval, x_aval, t_aval]), x, *init,
                               site=site, **params)
  return _done_lowering(ctx.replace(avals_in=[out_aval, x_aval, t_aval], avals_out=[out_aval]),
                        out, xa, t, key=params["key"], site=site, route=route_of(params), in_place=True)


def _collective_lowering_cuda(ctx, x, *init, **params):
  if _partially_manual(ctx):
    return _lower_fully_manual(ctx, x, params, *init)
  from jax_dfccl._src import lowering_plans  # (one collective lowered as several, where it must)
  if (several := lowering_plans.lower(ctx, x, params, init)) is not None:
    return several
  # One custom call: the ready write and the done wait go on the stream together.
  return _start_lowering(ctx, x, *init, site=next(_SITES), target="dfccl_collective", aliases={}, **params)


mlir.register_lowering(collective_p, _collective_lowering, cacheable=False)
mlir.register_lowering(collective_p, _collective_lowering_cuda, platform="cuda", cacheable=False)
mlir.register_lowering(start_p, _async_start_lowering, cacheable=False)
mlir.register_lowering(done_p, _done_lowering, cacheable=False)


def bind_blocking(x, params, *init):
  """The blocking collective on canonical input `x` (the op modules' transposes use it)."""
  return collective_p.bind(x, *init, **params)
