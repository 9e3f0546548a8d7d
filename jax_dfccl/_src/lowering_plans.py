"""One blocking collective lowered as several, where it must or is asked to.

- **Pieces**: a rank's input larger than one collective carries (a group spanning hosts:
  a receive slot's section, ``distributed.piece_bytes``; on any backend the test setting
  ``config.testing.piece_bytes``) runs as several collectives over pieces of every rank's
  input, one after another, under keys ``key/piece<j>``, joined as the op's
  ``OpDef.split`` says.
- **Two levels** (``config.tuning.two_level_plans``): over a group of hosts that each hold
  L > 1 consecutive ranks, psum (sum), all_gather and psum_scatter run inside each host
  and across hosts (``axis_index_groups``), keys ``key/host``, ``key/across``,
  ``key/host2`` — each rank sends 1/L of a flat plan's data between hosts.

Every rank lowers the same plan (the same sizes, mesh and settings), so the pieces and
stages meet by key like any collective.  Only the blocking forms: a start form's one
handle cannot stand for several collectives, so a start form that would need a plan is
refused when lowered (``check_start``; the size refusal: ``distributed.prepare_gpu_rows``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore
from jax._src.interpreters import mlir

from jax_dfccl._src import core as c
from jax_dfccl._src.keys import derive


def lower(ctx, x, params, init):
  """The blocking collective as several (a lowered value), or None: one collective."""
  if hl := _two_level(ctx, params, init):
    return _two_level_lowering(ctx, x, params, hl)
  if limit := _piece_bytes(ctx, params, init):
    return _split_lowering(ctx, x, params, limit)
  return None


def check_start(ctx, params, init) -> None:
  """Refuses a start form over a group the blocking form would run in two levels."""
  if _two_level(ctx, params, init):
    raise ValueError(f"jax_dfccl.{params['op']}_start: collective {params['key']!r} spans hosts of several ranks "
                     "each, where jax_dfccl.config.tuning.two_level_plans runs it in two levels, in the blocking "
                     "form only (a start form of it on another rank would never meet that): use the blocking "
                     "form, or turn two_level_plans off")


def _in_bytes(ctx) -> int:
  aval = ctx.avals_in[0]
  return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _lower_fun(ctx, x, f, mesh):
  with jcore.extend_axis_env_nd(tuple(mesh.shape.items())):  # (the binds' abstract evals need the axes)
    return mlir.lower_fun(f, multiple_results=False)(ctx, x)


def _piece_bytes(ctx, params, init) -> int:
  """The most bytes of a rank's input one collective carries here, where the op splits
  (OpDef.split) and its input is larger; else 0."""
  nbytes = _in_bytes(ctx)
  if not c.OPS[params["op"]].split or init or not nbytes:
    return 0
  from jax_dfccl.config import config
  limit = int(config.testing.piece_bytes)
  mesh = c._spmd_mesh(ctx, params["op"])
  if isinstance(mesh, jax.sharding.Mesh):
    from jax_dfccl._src import distributed
    theirs = distributed.piece_bytes(ctx, mesh, c.device_ids(mesh),
                                     lambda: c.group_table(mesh, params["axes"], params["groups"]), nbytes)
    limit = min(limit, theirs) if limit and theirs else limit or theirs
  return limit if limit and nbytes > limit else 0


def _split_lowering(ctx, x, params, limit):
  """Pieces of at most ``limit`` bytes of every rank's input, in order."""
  how = c.OPS[params["op"]].split
  mesh = c._spmd_mesh(ctx, params["op"])
  n = c.group_table(mesh, params["axes"], params["groups"]).shape[1]
  out_shape = ctx.avals_out[0].shape
  item = np.dtype(ctx.avals_in[0].dtype).itemsize
  rows = how in ("blocks", "blocks_reduce")

  def f(v):
    v = v.reshape(n, -1) if rows else v.reshape(-1)
    per = max(1, limit // (item * (n if rows else 1)))
    outs = [c.collective_p.bind(v[..., s:s + per], **derive(params, f"piece{j}"))
            for j, s in enumerate(range(0, v.shape[-1], per))]
    return jnp.concatenate(outs, axis=1 if how in ("gather", "blocks") else 0).reshape(out_shape)

  return _lower_fun(ctx, x, f, mesh)


def _two_level(ctx, params, init):
  """(H, L) where the collective runs in two levels: H hosts of L ranks each, every host's
  ranks consecutive in the group's rank order, the same in every group of the mesh."""
  from jax_dfccl.config import config
  op = params["op"]
  if (not config.tuning.two_level_plans or op not in ("psum", "all_gather", "psum_scatter") or init
      or params["groups"] or params.get("mode", "varying") != "varying"
      or (op == "psum" and params["reduce"] != "sum")):
    return None
  mesh = c._spmd_mesh(ctx, op)
  if not isinstance(mesh, jax.sharding.Mesh):
    return None
  from jax_dfccl._src import distributed
  ids = c.device_ids(mesh)
  shapes = {distributed.host_blocks([int(ids[i]) for i in row]) for row in c.group_table(mesh, params["axes"])}
  return shapes.pop() if len(shapes) == 1 and None not in shapes else None


def _two_level_lowering(ctx, x, params, hl):
  """psum: reduce-scatter inside the host, psum across, all_gather inside; all_gather:
  across, then inside; psum_scatter: inside, then across."""
  h_, l_ = hl
  op = params["op"]
  inside = tuple(tuple(h * l_ + l for l in range(l_)) for h in range(h_))
  across = tuple(tuple(h * l_ + l for h in range(h_)) for l in range(l_))

  def bind(v, name, tag, groups):
    return c.collective_p.bind(v, **{**derive(params, tag), "op": name, "groups": groups, "reduce": "sum"})

  def f(v):
    if op == "psum":
      flat = v.reshape(-1)
      m = flat.shape[0]
      flat = jnp.pad(flat, (0, (-m) % l_)).reshape(l_, -1)
      part = bind(flat, "psum_scatter", "host", inside)
      part = bind(part, "psum", "across", across)
      return bind(part, "all_gather", "host2", inside).reshape(-1)[:m].reshape(v.shape)
    if op == "all_gather":
      a = bind(v, "all_gather", "across", across)  # (H, ...): ranks h*L + l of every host
      b = bind(a, "all_gather", "host", inside)  # (L, H, ...)
      return jnp.swapaxes(b, 0, 1).reshape(ctx.avals_out[0].shape)
    # psum_scatter: v (N, ...) -> (L, H, ...) by position in the host, summed inside, then across
    w = jnp.swapaxes(v.reshape(h_, l_, *v.shape[1:]), 0, 1)
    part = bind(w, "psum_scatter", "host", inside)  # (H, ...)
    return bind(part, "psum_scatter", "across", across)

  return _lower_fun(ctx, x, f, c._spmd_mesh(ctx, op))
