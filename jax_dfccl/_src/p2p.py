"""Point-to-point ``send`` / ``recv`` between a shard of one program and a
device of another (MPMD: programs that differ per process, e.g. the stages of
a pipeline).

A send and its recv are the two halves of a ``ppermute`` over the group
``(sender device, receiver device)`` with permutation ``[(0, 1)]``: they meet
by ``(group, key, sequence)``, whatever order each program starts them in.
The sender's result is what ``jax.lax.ppermute`` gives a rank that receives
nothing (zeros like ``x``); the receiver's argument gives the result's shape
and dtype and the values are ignored.  Both are linear, and transpose like
that ppermute: the gradient of a ``recv`` is a send of the cotangent back to
the source, the gradient of a ``send`` a receive of it from the destination
(under the key ``key + "/T"``), so ``jax.vjp`` of a pipeline stage that
receives its input and sends its output runs the backward communication.

Peers are global device ids (or ``jax.Device``\\s): one for every shard, or a
sequence with one per device of the mesh (flat order, as
``mesh.devices.flat``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir

from jax_dfccl._src import core as c
from jax_dfccl._src import order
from jax_dfccl._src import keys
from jax_dfccl._src import plan as pl

p2p_p = core.Primitive("dfccl_p2p")
p2p_start_p = core.Primitive("dfccl_p2p_start")
p2p_start_p.multiple_results = True


def _abstract(aval, **params):
  return aval, {c.dfccl_effect}


def _start_abstract(aval, **params):
  return [aval, aval, c._ticket_aval(aval)], {c.dfccl_effect}


p2p_p.def_effectful_abstract_eval(_abstract)
p2p_start_p.def_effectful_abstract_eval(_start_abstract)
p2p_p.def_impl(c._no_impl)
p2p_start_p.def_impl(c._no_impl)


def _jvp(primals, tangents, **params):
  (x,), (t,) = primals, tangents
  y = p2p_p.bind(x, **params)
  if type(t) is ad.Zero:
    return y, ad.Zero(core.get_aval(y).to_tangent_aval())
  return y, p2p_p.bind(t, **keys.derive(params, "jvp"))


def _transpose(ct, x, **params):
  # The peer's transpose communicates whatever our cotangent is: never skip.
  ct = ad.instantiate_zeros(ct)
  inv = keys.derive(params, "T")
  inv["perm"] = tuple((d, s) for s, d in params["perm"])
  return [p2p_p.bind(ct, **inv)]


ad.primitive_jvps[p2p_p] = _jvp
ad.primitive_transposes[p2p_p] = _transpose
ad.primitive_jvps[p2p_start_p] = c._no_ad


def _batch(axis_data, vals_in, dims_in, **params):
  (x,), (d,) = vals_in, dims_in
  return p2p_p.bind(x, **params), d


def _start_batch(axis_data, vals_in, dims_in, **params):
  (x,), (d,) = vals_in, dims_in
  return p2p_start_p.bind(x, **params), [d, d, None]


batching.fancy_primitive_batchers[p2p_p] = _batch
batching.fancy_primitive_batchers[p2p_start_p] = _start_batch


def _rows(ctx, peers, role, api, arg):
  """device_ids and group rows: partition p's group is (sender, receiver)."""
  mesh = c._spmd_mesh(ctx, api)
  devs = c.device_ids(mesh)
  m = len(devs)
  peers = np.asarray(peers * m if len(peers) == 1 else peers, dtype=np.int64)
  if len(peers) != m:
    raise ValueError(f"jax_dfccl.{api}: {arg} names {len(peers)} devices; the mesh has {m} "
                     "(give one device, or one per device of the mesh in flat order)")
  if np.any(peers == devs):
    raise ValueError(f"jax_dfccl.{api}: {arg} names the shard's own device {int(devs[peers == devs][0])}")
  if isinstance(mesh, jax.sharding.Mesh):
    from jax_dfccl._src import distributed
    by_id = {d.id: d for d in jax.devices()}
    unknown = sorted({int(i) for i in peers if int(i) not in by_id})
    if unknown:
      raise ValueError(f"jax_dfccl.{api}: {arg} names device id(s) {unknown}, not devices of this job")
    distributed.check_reach(list(mesh.devices.flat) + [by_id[i] for i in peers if i in by_id], api)
  rows = [[p, m + p] if role == "send" else [m + p, p] for p in range(m)]
  ids = np.concatenate([devs, peers])
  from jax_dfccl._src import distributed
  distributed.prepare_gpu_rows(ctx, mesh, ids, rows, wait=False)  # (sender, receiver) pairs
  return ids, np.asarray(rows, dtype=np.int32).reshape(-1)


def _start(ctx, x, *, peers, role, perm, key, key_hash, site, api, arg, op):
  ids, rows = _rows(ctx, peers, role, api, arg)
  from jax_dfccl._src import backend
  backend.load()
  rule = jax.ffi.ffi_lowering("dfccl_start", operand_output_aliases={0: 1}, has_side_effect=True)
  sub = ctx.replace(avals_in=[ctx.avals_in[0], c._PID_AVAL])
  return rule(sub, x, c._partition_id_operand(ctx), kind=np.int32(c.KIND["ppermute"]), reduce_op=np.int32(0),
              key=key, key_hash=np.int64(key_hash), site=np.int64(site), group_size=np.int32(2),
              groups=rows, device_ids=ids, perm=np.asarray(perm, dtype=np.int32).reshape(-1))


def _lowering(ctx, x, **params):
  site = next(c._SITES)
  (x_aval,), (out_aval,) = ctx.avals_in, ctx.avals_out
  out, xa, t = _start(ctx.replace(avals_out=[out_aval, x_aval, c._TICKET]), x, site=site, **params)
  return c._done_lowering(ctx.replace(avals_in=[out_aval, x_aval, c._TICKET], avals_out=[out_aval]),
                          out, xa, t, key=params["key"], site=site, in_place=True)


def _start_lowering(ctx, x, *, site, **params):
  if not getattr(site, "done", True):
    raise ValueError(f"jax_dfccl: the handle of {params['api']}_start {params['key']!r} is never passed "
                     "to jax_dfccl.done in this program; every *_start needs exactly one done")
  return _start(ctx, x, site=site, **params)


mlir.register_lowering(p2p_p, _lowering, cacheable=False)
mlir.register_lowering(p2p_start_p, _start_lowering, cacheable=False)


def _peers(dev, api, arg) -> tuple:
  def one(d):
    if isinstance(d, jax.Device):
      return int(d.id)
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
      return int(d)
    raise TypeError(f"jax_dfccl.{api}: {arg} must be a jax.Device, a device id or a sequence of them, got {d!r}")
  if isinstance(dev, Sequence) or isinstance(dev, np.ndarray):
    out = tuple(one(d) for d in (dev.flat if isinstance(dev, np.ndarray) else dev))
    if not out:
      raise ValueError(f"jax_dfccl.{api}: {arg} is empty")
    return out
  return (one(dev),)


def _varying(x):
  """Each shard receives its own value: type the result as varying over every
  mesh axis (like a ppermute's), not as the placeholder's."""
  axes = tuple(jax.sharding.get_abstract_mesh().axis_names)
  return c.make_varying(x, axes) if axes else x


def _plan(api, x, peer, arg, key):
  if not isinstance(key, str) or not key:
    raise TypeError(f"jax_dfccl.{api}: key must be a non-empty string naming the transfer "
                    f"(the sender and the receiver run different programs), got {key!r}")
  leaves, treedef = jax.tree.flatten(x)
  peers = _peers(peer, api, arg)
  role = "send" if api == "send" else "recv"
  out = []
  for i, leaf in enumerate(leaves):
    pl.check_dtype(leaf, api, movement=True)
    leaf = _varying(jnp.asarray(leaf))
    k = key + (f"[{i}]" if len(leaves) > 1 else "")
    params = dict(op="ppermute", peers=peers, role=role, perm=((0, 1),), key=k, key_hash=keys.hash64("p2p:" + k), api=api, arg=arg)
    out.append(pl.make_leaf(leaf, params))
  return out, treedef


def _run(api, x, peer, arg, key):
  leaves, treedef = _plan(api, x, peer, arg, key)
  return jax.tree.unflatten(treedef, [lf.post(order.bind_wait(p2p_p, lf.x, **lf.params)) for lf in leaves])


def _run_start(api, x, peer, arg, key):
  leaves, treedef = _plan(api, x, peer, arg, key)
  arrays, sites = [], []
  for lf in leaves:
    site = c.CallSite(next(c._SITES))
    arrays.extend(p2p_start_p.bind(lf.x, site=site, **lf.params))
    order.issued(arrays[-1], wait=False)  # its ticket
    sites.append(site)
  return pl.Handle(arrays, pl._HandleState(api, [lf.post for lf in leaves], treedef,
                                           [lf.params["key"] for lf in leaves], sites))


def send(x, dst, *, key: str):
  """Sends ``x`` to another device, where a :func:`recv` with the same ``key`` receives it.

  The sender's half of a point-to-point transfer between programs that may differ per
  process or device (MPMD: pipeline stages).  It waits until the receiver has started its
  recv (:func:`send_start` does not).  Its transpose receives the cotangent back from
  ``dst`` (key ``key + "/T"``), so ``jax.grad`` of a pipeline stage runs the backward transfer.

  Args:
    x: an array or a pytree of arrays (this shard's value; any fixed-width dtype).
    dst: the destination device: a ``jax.Device`` or a global device id for every shard, or a
      sequence with one per device of the mesh (flat order, as ``mesh.devices.flat``); never
      the shard's own device.
    key: the transfer's name (required: the two sides may run different programs); a
      send and a recv with one key meet whatever order each side starts them in.

  Returns:
    Zeros like ``x`` (what ``jax.lax.ppermute`` gives a rank that receives nothing).

  Raises:
    TypeError: ``key`` missing or empty, a peer that is not a device or an id, or an
      unsupported dtype.
    ValueError: when the program is lowered: a peer list of the wrong length, a shard's own
      device, or a device not in this job.

  Example:
    >>> d0, d1 = jax.devices()[:2]
    >>> mesh = jax.sharding.Mesh([d0, d1], ("x",))
    >>> def swap(v):  # each device sends its shard to the other one
    ...   r = jax_dfccl.recv_start(jnp.zeros_like(v), [d1, d0], key="swap")
    ...   jax_dfccl.send(v, [d1, d0], key="swap")
    ...   return jax_dfccl.done(r)
    >>> f = jax.jit(jax.shard_map(swap, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    >>> print(f(jnp.arange(4.0)))
    [2. 3. 0. 1.]

  """
  return _run("send", x, dst, "dst", key)


def recv(x, src, *, key: str):
  """Receives what device ``src`` sends with :func:`send` under ``key``.

  The receiver's half of a point-to-point transfer (see :func:`send`).  Its transpose sends
  the cotangent back to ``src``, so differentiating a stage with respect to what it
  received returns that gradient to its sender.

  Args:
    x: an array or a pytree of arrays giving the result's shapes and dtypes (e.g.
      ``jnp.zeros(shape, dtype)``); its values are ignored.
    src: the source device: a ``jax.Device`` or a global device id for every shard, or a
      sequence with one per device of the mesh (flat order, as ``mesh.devices.flat``); never
      the shard's own device.
    key: the transfer's name (required: the two sides may run different programs); a
      send and a recv with one key meet whatever order each side starts them in.

  Returns:
    What ``src`` sent, of ``x``'s shapes and dtypes.

  Raises:
    TypeError: ``key`` missing or empty, a peer that is not a device or an id, or an
      unsupported dtype.
    ValueError: when the program is lowered: a peer list of the wrong length, a shard's own
      device, or a device not in this job.

  Example:
    >>> d0, d1 = jax.devices()[:2]
    >>> mesh = jax.sharding.Mesh([d0, d1], ("x",))
    >>> def swap(v):  # each device sends its shard to the other one
    ...   s = jax_dfccl.send_start(v, [d1, d0], key="swap")
    ...   r = jax_dfccl.recv(jnp.zeros_like(v), [d1, d0], key="swap")
    ...   jax_dfccl.done(s)
    ...   return r
    >>> f = jax.jit(jax.shard_map(swap, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    >>> print(f(jnp.arange(4.0)))
    [2. 3. 0. 1.]

  """
  return _run("recv", x, src, "src", key)


def send_start(x, dst, *, key: str) -> pl.Handle:
  return _run_start("send", x, dst, "dst", key)


def recv_start(x, src, *, key: str) -> pl.Handle:
  return _run_start("recv", x, src, "src", key)


def _start_doc(api: str, arg: str, what: str, result: str) -> str:
  """The docstring of ``send_start`` / ``recv_start`` (one text: they differ in names only)."""
  return f"""Starts :func:`{api}` and returns a handle; ``jax_dfccl.done(handle)`` returns {what}.

  Args:
    x: as :func:`{api}`.
    {arg}: as :func:`{api}`.
    key: the transfer's name (required: the two sides may run different programs); a
      send and a recv with one key meet whatever order each side starts them in.

  Returns:
    A :class:`jax_dfccl.Handle` for :func:`jax_dfccl.done` (which returns {result}).

  Raises:
    TypeError: ``key`` missing or empty, a peer that is not a device or an id, or an
      unsupported dtype.
    ValueError: when the program is lowered: a peer list of the wrong length, a shard's own
      device, or a device not in this job.
    NotImplementedError: under autodiff (handles are not differentiable).

  Example:
    >>> d0, d1 = jax.devices()[:2]
    >>> mesh = jax.sharding.Mesh([d0, d1], ("x",))
    >>> def swap(v):  # each device sends its shard to the other one
    ...   s = jax_dfccl.send_start(v, [d1, d0], key="swap")
    ...   r = jax_dfccl.recv_start(jnp.zeros_like(v), [d1, d0], key="swap")
    ...   jax_dfccl.done(s)
    ...   return jax_dfccl.done(r)
    >>> f = jax.jit(jax.shard_map(swap, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    >>> print(f(jnp.arange(4.0)))
    [2. 3. 0. 1.]

  """


send_start.__doc__ = _start_doc("send", "dst", "its result", "zeros like ``x``")
recv_start.__doc__ = _start_doc("recv", "src", "the received value", "what ``src`` sent")
