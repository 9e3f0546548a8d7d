"""send / recv between two programs of one process (each on its own device),
their transposes, and their trace-time errors.  Across processes:
tests/multiprocess/."""
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_dfccl as dc


def _on(dev, f):
  mesh = Mesh(np.array([dev]), ("s",))
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))


def _both(fa, a, fb, b):
  """Runs two programs at once (threads: each waits for the other's transfer)."""
  out = {}
  ta = threading.Thread(target=lambda: out.__setitem__("a", jax.block_until_ready(fa(a))))
  ta.start()
  out["b"] = jax.block_until_ready(fb(b))
  ta.join(60)
  return out["a"], out["b"]


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int8, np.bool_])
def test_send_recv_between_programs(dtype):
  d0, d1 = jax.devices()[:2]
  x = (np.arange(12).reshape(3, 4) % 5).astype(dtype)
  sender = _on(d0, lambda v: dc.send(v, d1, key="t"))
  receiver = _on(d1, lambda z: dc.recv(z, d0, key="t"))
  sent, got = _both(sender, x, receiver, np.zeros_like(x))
  np.testing.assert_array_equal(np.asarray(got), x)
  np.testing.assert_array_equal(np.asarray(sent), np.zeros_like(x))  # like ppermute's non-receiver


def test_start_forms_any_order():
  d0, d1 = jax.devices()[:2]
  x = np.arange(8, dtype=np.float32)

  def a(v):  # starts its receive before its send
    h = dc.recv_start(v, d1, key="b2a")
    s = dc.send_start(v * 2, d1, key="a2b")
    r = dc.done(h)
    dc.done(s)
    return r

  def b(v):  # the other way round
    s = dc.send_start(v + 1, d0, key="b2a")
    h = dc.recv_start(v, d0, key="a2b")
    dc.done(s)
    return dc.done(h)
  ra, rb = _both(_on(d0, a), x, _on(d1, b), x)
  np.testing.assert_array_equal(np.asarray(ra), x + 1)
  np.testing.assert_array_equal(np.asarray(rb), x * 2)


def test_gradients_flow_back():
  """vjp of the receiving program sends the cotangent back; vjp of the sending
  program receives it: d/dw sum(sin(w x)^2) = sum(2 sin(wx) cos(wx) x)."""
  d0, d1 = jax.devices()[:2]
  x = np.linspace(-1, 1, 6).astype(np.float32)

  def stage0(w):
    out, vjp = jax.vjp(lambda w: dc.send(jnp.sin(w * x), d1, key="act"), w)
    ct = jax.lax.optimization_barrier((jnp.zeros_like(out), out))[0]
    return vjp(ct)[0]

  def stage1(z):
    l, vjp = jax.vjp(lambda z: jnp.sum(dc.recv(z, d0, key="act") ** 2), z)
    return l, vjp(jnp.ones_like(l))[0]
  g, (l, gz) = _both(_on(d0, stage0), np.float32(1.5), _on(d1, stage1), np.zeros_like(x))
  want_g = np.sum(2 * np.sin(1.5 * x) * np.cos(1.5 * x) * x)
  np.testing.assert_allclose(float(g), want_g, rtol=1e-5)
  np.testing.assert_allclose(float(l), np.sum(np.sin(1.5 * x) ** 2), rtol=1e-6)
  assert not np.any(np.asarray(gz))


def test_errors_name_function_and_argument():
  d0, d1 = jax.devices()[:2]
  x = np.zeros(3, np.float32)
  with pytest.raises(TypeError, match=r"jax_dfccl.send: key"):
    _on(d0, lambda v: dc.send(v, d1, key=None))(x)
  with pytest.raises(TypeError, match=r"jax_dfccl.recv: src"):
    _on(d0, lambda v: dc.recv(v, "cpu:1", key="k"))(x)
  with pytest.raises(ValueError, match=r"jax_dfccl.send: dst names the shard's own device"):
    _on(d0, lambda v: dc.send(v, d0, key="k"))(x)
  with pytest.raises(ValueError, match=r"jax_dfccl.recv: src names 3 devices; the mesh has 1"):
    _on(d0, lambda v: dc.recv(v, jax.devices()[1:4], key="k"))(x)
  with pytest.raises(ValueError, match=r"never passed to jax_dfccl.done"):
    _on(d0, lambda v: (dc.send_start(v, d1, key="k"), v)[1])(x)
