"""Order-free semantics: collectives matched by key + sequence, never by issue
order; errors (not hangs) for missing peers and mismatched ranks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dfccl as dc
from conftest import put

from jax_dfccl import testing as T

N = 8


def test_chaos_order(mesh8):
  """8 collectives started in a rank-specific order and done in another, 100 iterations."""
  xs = T.chaos_inputs(mesh8, "x")
  ours = T.chaos_program(mesh8, "x", 100)(*xs)
  ref = T.reference_program(mesh8, "x", 100)(*xs)
  for (name, *_), a, b in zip(T.collectives("x", N), ours, ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_branches_really_differ(mesh8):
  """The starts stay inside the rank-specific branches (not hoisted by XLA)."""
  xs = T.chaos_inputs(mesh8, "x")
  hlo = T.chaos_program(mesh8, "x", 2).lower(*xs).compile().as_text()
  # 8 branches x 8 starts, each its own custom call inside a conditional.
  assert hlo.count('custom_call_target="dfccl_start"') >= N * N
  assert "conditional" in hlo


def test_reentrant_key_in_loop(mesh8):
  """One key re-entered in fori_loop and scan: sequence numbers keep instances apart."""
  x = put(jnp.arange(8.0), mesh8, P("x"))

  def body(v):
    def step(c, _):
      return c + dc.psum(v, "x", key="loop/psum"), None
    a, _ = jax.lax.scan(step, jnp.zeros_like(v), None, length=5)
    # The same key again, after the scan (a key used at several program points
    # must be reached in the same order on every rank: here a data dependency).
    b = jax.lax.fori_loop(0, 3, lambda i, c: c + dc.psum(v * i, "x", key="loop/psum"),
                          jnp.zeros_like(v) + 0 * a)
    return a, b
  a, b = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x"),
                               check_vma=False))(x)
  np.testing.assert_array_equal(a, np.full(8, 5 * 28.0))
  np.testing.assert_array_equal(b, np.full(8, 3 * 28.0))
  assert dc.stats()["cpu"]["instances_live"] == 0


def test_two_programs_in_flight(mesh8):
  """Two jitted programs dispatched back to back share the runtime."""
  x = put(jnp.arange(8.0), mesh8, P("x"))
  f = jax.jit(jax.shard_map(lambda v: dc.psum(v, "x"), mesh=mesh8, in_specs=P("x"),
                            out_specs=P()))
  g = jax.jit(jax.shard_map(lambda v: dc.all_gather(v, "x", tiled=True), mesh=mesh8,
                            in_specs=P("x"), out_specs=P("x")))
  outs = [(f(x + i), g(x * i)) for i in range(10)]
  for i, (a, b) in enumerate(outs):
    np.testing.assert_array_equal(a, np.full(1, 28.0 + 8 * i))
    np.testing.assert_array_equal(b, np.tile(np.arange(8.0) * i, 8))


def _drain():
  """Collects the failed program's error on every device (else JAX re-raises it at exit)."""
  try:
    jax.effects_barrier()
  except Exception:
    pass


def _lonely(mesh8):
  def body(v):
    def lonely(v):
      return dc.psum(v, "x", key="lonely/psum")
    return jax.lax.cond(jax.lax.axis_index("x") < 2, lonely, lambda v: v, v)
  return jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x"),
                               check_vma=False))


def test_timeout_names_key_and_missing_ranks(mesh8):
  dc.configure(timeout_s=1.0)
  x = put(jnp.arange(8.0), mesh8, P("x"))
  with pytest.raises(Exception) as e:
    jax.block_until_ready(_lonely(mesh8)(x))
  _drain()
  msg = str(e.value)
  assert "lonely/psum" in msg and "seq 0" in msg, msg
  assert "never" in msg and "2" in msg and "7" in msg, msg
  dc.reset()
  # The runtime is usable afterwards.
  f = jax.jit(jax.shard_map(lambda v: dc.psum(v, "x"), mesh=mesh8, in_specs=P("x"),
                            out_specs=P()))
  np.testing.assert_array_equal(f(x), [28.0])


def test_mismatch_names_key_and_ranks(mesh8):
  dc.configure(timeout_s=20.0)
  x = put(jnp.arange(64.0), mesh8, P("x"))

  def body(v):
    def small(v):
      return jnp.zeros_like(v).at[:4].set(dc.psum(v[:4], "x", key="mm/psum"))
    def full(v):
      return dc.psum(v, "x", key="mm/psum")
    return jax.lax.cond(jax.lax.axis_index("x") == 3, small, full, v)
  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x"),
                            check_vma=False))
  with pytest.raises(Exception) as e:
    jax.block_until_ready(f(x))
  _drain()
  msg = str(e.value)
  assert "mm/psum" in msg and "mismatch" in msg and "rank 3" in msg, msg
  dc.reset()


def test_trace_time_errors(mesh8):
  x = put(jnp.arange(16.0), mesh8, P("x"))
  sm = lambda fn, **kw: jax.jit(jax.shard_map(fn, mesh=mesh8, in_specs=P("x"),
                                              out_specs=P("x"), check_vma=False)).trace(x)
  with pytest.raises(NameError, match=r"jax_dfccl\.psum: Found an unbound axis name: z\. .*'z'"):
    sm(lambda v: dc.psum(v, "z"))
  with pytest.raises(NameError, match="unbound axis"):
    dc.psum(jnp.ones(3), "x")
  with pytest.raises(ValueError, match="not divisible"):
    sm(lambda v: dc.psum_scatter(v[:3], "x", tiled=True))
  with pytest.raises(ValueError, match="group size"):
    sm(lambda v: dc.psum_scatter(v, "x"))
  with pytest.raises(ValueError, match="not divisible"):
    sm(lambda v: dc.all_to_all(v[:5], "x", 0, 0, tiled=True))
  with pytest.raises(TypeError, match="unsupported dtype complex64"):
    sm(lambda v: dc.pmax(v.astype(jnp.complex64), "x"))
  with pytest.raises(TypeError, match="unsupported dtype bool"):
    sm(lambda v: dc.psum_scatter(v > 0, "x", tiled=True))
  with pytest.raises(ValueError, match="unique"):
    sm(lambda v: dc.ppermute(v, "x", [(0, 1), (0, 2)]))

  def twice(v):
    h = dc.psum_start(v, "x")
    dc.done(h)
    return dc.done(h)
  with pytest.raises(ValueError, match="already done"):
    sm(twice)
  with pytest.raises(TypeError, match="non-empty string"):
    sm(lambda v: dc.psum(v, "x", key=3))


def test_handle_never_done_is_an_error(mesh8):
  """Refused when the program is lowered: the runtime would write into freed buffers."""
  x = put(jnp.arange(8.0), mesh8, P("x"))

  def body(v):
    dc.psum_start(v, "x", key="forgotten")  # never passed to done
    return v * 2
  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x")))
  with pytest.raises(ValueError, match="forgotten.*never passed to jax_dfccl.done"):
    f(x)


def test_the_done_check_keeps_no_process_state(mesh8):
  """The start-without-done check reads the traced program's own call sites: after a program whose
  handle reached done, a second program with the same key and no done is still refused, and the
  first one still runs exactly."""
  from jax_dfccl._src import core
  x = put(jnp.arange(8.0), mesh8, P("x"))
  good = jax.jit(jax.shard_map(lambda v: dc.done(dc.psum_start(v, "x", key="k")), mesh=mesh8,
                               in_specs=P("x"), out_specs=P("x")))
  np.testing.assert_array_equal(np.asarray(good(x)), np.full(8, 28.0))

  def bad(v):
    dc.psum_start(v, "x", key="k")
    return v
  with pytest.raises(ValueError, match="never passed to jax_dfccl.done"):
    jax.jit(jax.shard_map(bad, mesh=mesh8, in_specs=P("x"), out_specs=P("x")))(x)
  np.testing.assert_array_equal(np.asarray(good(x)), np.full(8, 28.0))
  assert not hasattr(core, "_DONE_SITES")


def test_alternating_chaos_workload(mesh8):
  """The benchmark's psum/all_gather chaos workload equals its jax.lax reference."""
  x = put(jnp.asarray(np.random.default_rng(2).integers(-9, 9, (8 * 64,)), jnp.float32), mesh8, P("x"))
  sm = lambda body: jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x"),
                                          check_vma=False))
  ours = sm(T.alternating_chaos("x", 8, 64, seed=3))(x)
  ref = sm(T.alternating_reference("x", 64))(x)
  np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("platform,want", [
    ("cpu", ["dfccl_start", "dfccl_done", "dfccl_start", "dfccl_done"]),
    ("cuda", ["dfccl_collective", "dfccl_start", "dfccl_done"]),
])
def test_lowering_per_platform(mesh8, platform, want):
  """A blocking psum is one dfccl_collective custom call on CUDA, start + done on CPU;
  the *_start form is start + done on both (lowered for CUDA without a GPU)."""
  import re

  def body(y):
    y = dc.psum(y, "x") * 0.5
    return dc.done(dc.psum_start(y, "x"))

  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x")))
  txt = f.trace(jnp.ones((N, 16))).lower(lowering_platforms=(platform,)).as_text()
  assert re.findall(r"custom_call @(dfccl_\w+)", txt) == want


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_partition_id_operand_per_platform(mesh8, platform):
  """The CPU handlers read the partition-id operand; the CUDA handlers find the rank from
  their GPU, so a program lowered for CUDA passes a constant (XLA would compute a partition
  id with two kernels per execution, and per iteration inside a loop)."""
  import re

  def body(y):
    y = jax.lax.fori_loop(0, 3, lambda i, v: dc.psum(v, "x") * 0.5, y)
    return dc.ppermute(y, "x", [(i, (i + 1) % N) for i in range(N)])

  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  txt = f.trace(jnp.ones((N, 16))).lower(lowering_platforms=(platform,)).as_text()
  calls = re.findall(r"custom_call @dfccl_\w+", txt)
  assert len(calls) >= 2, txt
  assert ("stablehlo.partition_id" in txt) == (platform == "cpu"), txt


@pytest.mark.parametrize("op", ["psum", "ppermute"])
def test_handle_with_other_users_is_not_copied_in_flight(mesh8, op):
  """A handle that also goes through an optimization barrier (a pipeline's way
  of ordering its steps) still yields the transfer: XLA copies a buffer an
  instruction updates in place when its value has another user, so done must
  not update the start's result in place (the copy would read it before the
  transfer landed).  One rank starts late so a copy taken early reads stale data."""
  x = put(jnp.arange(8.0 * 4).reshape(8, 4) + 1, mesh8, P("x"))
  perm = [(i, (i + 1) % N) for i in range(N)]

  def body(v):
    if op == "psum":
      h, ref = dc.psum_start(v, "x", key="kept"), jax.lax.psum(v, "x")
    else:
      h, ref = dc.ppermute_start(v, "x", perm, key="kept"), jax.lax.ppermute(v, "x", perm)
    h2, w = jax.lax.optimization_barrier((h, v * 3))  # the handle has two users
    return dc.done(h2) - ref + 0 * jax.lax.optimization_barrier((h, w))[1]

  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  import re
  hlo = f.lower(x).compile().as_text()
  copies = set(re.findall(r"%(\S+) = \S+ copy\(", hlo))
  done_args = re.findall(r'custom-call\(%([^,)]+)[^\n]*custom_call_target="dfccl_done"', hlo)
  assert done_args and not copies & set(done_args), (copies, done_args)
  with dc.configured(fault_device=3, fault_start_delay_us=50e3):
    for _ in range(3):
      np.testing.assert_array_equal(np.asarray(f(x)), np.zeros((8, 4), np.float32))


def _ancestors(jaxpr):
  """For each equation of ``jaxpr`` (the body of its one shard_map), the indices of the equations
  its inputs depend on."""
  (eqn,) = [e for e in jaxpr.eqns if "jaxpr" in e.params]
  body = eqn.params["jaxpr"]
  body = getattr(body, "jaxpr", body)
  made, anc = {}, []
  for i, e in enumerate(body.eqns):
    deps = set()
    for v in e.invars:
      if v in made:
        deps |= {made[v]} | anc[made[v]]
    anc.append(deps)
    for v in e.outvars:
      made[v] = i
  return body.eqns, anc


def _find(eqns, prim, key):
  return next(i for i, e in enumerate(eqns) if e.primitive.name == prim and e.params.get("key") == key)


def test_waits_run_in_program_order(mesh8):
  """A wait is tied after every collective traced before it: XLA orders by data dependence only,
  and a done hoisted above a later-traced collective that another program's rank needs first is a
  deadlock across programs.  Starts and blocking collectives are tied to nothing (blocking ones
  traced in a rank-specific order would otherwise each hold a rank's stream)."""
  def body(v):
    h = dc.psum_start(v, "x", key="A")
    b = dc.psum(v, "x", key="B")           # blocking: tied to nothing
    g = dc.all_gather_start(v, "x", key="C")  # a start: tied to nothing
    e = dc.psum(v, "x", key="E")           # blocking: not after B
    return dc.done(h) + b + e, dc.done(g)   # done A after B, start C and E; done C after done A
  f = jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=(P("x"), P("x")), check_vma=False)
  x = put(jnp.arange(8.0), mesh8, P("x"))
  eqns, anc = _ancestors(jax.make_jaxpr(f)(x).jaxpr)
  start_a, b = _find(eqns, "dfccl_start", "A"), _find(eqns, "dfccl_collective", "B")
  start_c, e = _find(eqns, "dfccl_start", "C"), _find(eqns, "dfccl_collective", "E")
  done_a, done_c = _find(eqns, "dfccl_done", "A"), _find(eqns, "dfccl_done", "C")
  assert {start_a, b, start_c, e} <= anc[done_a]
  assert done_a in anc[done_c]
  assert not anc[start_a] and not anc[b] and not anc[start_c] and not anc[e]
  ya, yc = jax.jit(f)(x)
  np.testing.assert_array_equal(ya, np.full(8, 84.0))
  np.testing.assert_array_equal(np.asarray(yc).reshape(8, 8), np.tile(np.arange(8.0), (8, 1)))
  from jax_dfccl._src import order
  assert not order._ORDER  # lowering let go of the finished trace's values
