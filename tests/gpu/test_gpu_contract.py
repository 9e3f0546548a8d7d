"""The shared contracts on the CUDA backend (run with `pytest -m gpu tests/gpu/test_gpu_contract.py`);
the CPU backend's: tests/test_contract.py.

* the runtime holds exactly the configuration Python set (jax_dfccl/config.py is the one schema);
* stats() has exactly the documented keys (backend.STATS_KEYS + STATS_EXTRAS["cuda"]);
* a fused overlap op whose peer never arrives fails the program that ran it, and its error has the
  collectives' words (key, sequence, group, missing ranks) and path (raise_if_failed(),
  stats()["errors"]; in a subprocess: the kernels trap, which loses the GPUs' contexts).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jax_dfccl.testing import gpus  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(len(gpus()) < 1, reason="needs a GPU")]
needs_peer = pytest.mark.skipif(len(gpus()) < 2, reason="needs >= 2 GPUs")

if len(gpus()) >= 1:
  import jax_dfccl as dc
  from jax_dfccl._src import backend
  from jax_dfccl.config import Config


def _cuda():
  return backend.load()["cuda"]


def test_cuda_runtime_holds_every_gpu_entry_as_python_set():
  got = _cuda().config()
  fields = Config().as_dict()
  assert set(got) <= set(fields), set(got) - set(fields)
  # Every GPU entry of the schema reaches the runtime (the ones it does not read are CPU-only or
  # read at trace time).
  from jax_dfccl.config import CPU_ONLY_ENTRIES, INIT_ENTRIES, TRACE_TIME_ENTRIES
  assert set(fields) - set(got) == CPU_ONLY_ENTRIES | INIT_ENTRIES | TRACE_TIME_ENTRIES
  for k, v in got.items():
    assert v == dc.config.as_dict()[k] and type(v) is type(dc.config.as_dict()[k]), (k, v)


def test_cuda_runtime_reports_exactly_what_python_set():
  new = {"timeout_s": 61.5, "spin_budget_us": 3.25, "sticky_budget_us": 250.0, "idle_quit_us": 700.0,
         "stall_quit_us": 30000.0, "max_blocks": 9, "large_max_blocks": 33,
         "ll": False, "direct": False, "small_chunk": 8192, "relaunch_max_us": 1500.0,
         "copy_engine_min_bytes": -1}
  with dc.configured(**new):
    got = _cuda().config()
    assert {k: got[k] for k in new} == new
    assert got == {k: dc.config.as_dict()[k] for k in got}
    assert dc.stats()["cuda"]["sms_default"] == 9 and dc.stats()["cuda"]["sms_large"] == 33
  assert _cuda().config() == {k: dc.config.as_dict()[k] for k in got}


def test_rejected_value_changes_nothing_in_any_runtime():
  before = dc.config.as_dict()
  rts = {p: dict(rt.config()) for p, rt in backend.load().items()}
  with pytest.raises(ValueError, match="max_blocks"):
    dc.configure(timeout_s=42.0, max_blocks=65)  # the CPU runtime took timeout_s first
  assert dc.config.as_dict() == before
  assert {p: dict(rt.config()) for p, rt in backend.load().items()} == rts


def test_cuda_stats_keys_are_the_documented_table():
  s = dc.stats()["cuda"]
  assert set(s) == set(backend.STATS_KEYS) | set(backend.STATS_EXTRAS["cuda"]), \
      set(s) ^ (set(backend.STATS_KEYS) | set(backend.STATS_EXTRAS["cuda"]))
  assert isinstance(s["errors"], list)
  assert s["pending"] == s["started"] - s["completed"] - s["failed"]


@needs_peer
def test_cuda_stats_count_collectives():
  n = len(gpus())
  mesh = Mesh(np.array(gpus()), ("x",))
  f = jax.jit(jax.shard_map(lambda v: dc.psum(v, "x", key="contract/psum"), mesh=mesh, in_specs=P("x"),
                            out_specs=P("x")))
  x = jnp.arange(n * 256, dtype=jnp.float32)
  before = dc.stats()["cuda"]
  jax.block_until_ready(f(x))
  after = dc.stats()["cuda"]
  assert after["started"] - before["started"] == n
  # The proxy thread counts completions as it sees them: wait for it.
  import time
  deadline = time.monotonic() + 5
  while dc.stats()["cuda"]["completed"] - before["completed"] < n and time.monotonic() < deadline:
    time.sleep(0.01)
  assert dc.stats()["cuda"]["completed"] - before["completed"] == n


_OVERLAP_TIMEOUT = textwrap.dedent("""
  import json, os, sys
  import numpy as np, jax, jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_dfccl as dc
  from jax_dfccl._src import overlap as ov
  from jax_dfccl.testing import gpus
  devs = gpus()[:2]
  mesh = Mesh(np.array(devs), ("tp",))
  dc.configure(timeout_s=1.0)  # the one user timeout bounds the fused ops too
  x = jnp.ones((512, 256), jnp.bfloat16); w = jnp.ones((256, 512), jnp.bfloat16)
  def body(x, w):  # rank 1 never runs the fused op: rank 0's instance times out
    fused = lambda x, w: ov.all_gather_matmul(x, w, "tp")
    other = lambda x, w: jnp.zeros((x.shape[0] * 2, w.shape[1]), x.dtype)
    return jax.lax.cond(jax.lax.axis_index("tp") == 0, fused, other, x, w)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                            out_specs=P(None, "tp"), check_vma=False))
  xs = jax.device_put(x, NamedSharding(mesh, P("tp", None))); ws = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
  print("DEVICES", json.dumps([d.id for d in devs]), flush=True)
  try:
    out = np.asarray(jax.block_until_ready(f(xs, ws)))
    print("RESULT", float(out.astype(np.float32).sum()), flush=True)
  except Exception as e:
    print("FAILED", type(e).__name__, flush=True)
  try:
    dc.raise_if_failed()
    print("RAISED none", flush=True)
  except RuntimeError as e:
    print("RAISED", json.dumps(str(e)), flush=True)
  print("ERRORS", json.dumps(dc.stats()["cuda"]["errors"]), flush=True)
  os._exit(0)
""")


def _line(out, tag):
  import json
  lines = [ln for ln in out.splitlines() if ln.startswith(tag + " ")]
  assert lines, out
  rest = lines[0][len(tag) + 1:]
  return json.loads(rest) if rest[:1] in "[{\"" else rest


@needs_peer
def test_overlap_timeout_fails_with_the_collectives_code_and_words():
  """The error contract for the fused ops: DEADLINE_EXCEEDED's words (key, sequence, group, the rank
  that never started it), through raise_if_failed() and stats()["errors"] like any collective."""
  from jax_dfccl._src import overlap_gpu as og
  if not og.available():
    pytest.skip("the fused overlap kernels are not built")
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.3")
  p = subprocess.run([sys.executable, "-c", _OVERLAP_TIMEOUT], capture_output=True, text=True, timeout=300, env=env)
  out = p.stdout + p.stderr
  assert "RESULT" not in p.stdout, out  # never a result
  assert "FAILED" in p.stdout, out
  d0, d1 = _line(p.stdout, "DEVICES")
  # Per shard: x (256, 256), w (256, 256); the first instance of the key on the group.
  want = (f"dfccl: collective 'ag:256x256@256x256:bfloat16' (sequence 1, group of GPUs [{d0},{d1}]) "
          f"timed out after 1 s: rank(s) [1 (GPU {d1})] never started it")
  raised = _line(p.stdout, "RAISED")
  assert raised.startswith(want), (raised, want)
  assert any(e.startswith(want) for e in _line(p.stdout, "ERRORS")), out
  assert want in p.stderr, p.stderr  # printed as it happened
