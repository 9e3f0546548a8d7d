"""examples/train_transformer.py on 8 CPU devices (2 x 4 mesh): 20 training steps with jax_dfccl
(data parallelism through patch_lax, tensor parallelism through all_gather_matmul /
matmul_reduce_scatter, a mixture of experts through ragged_all_to_all) against the same model built
from jax.lax collectives with a dense mixture of experts (XLA:CPU has no ragged_all_to_all)."""
import collections
import importlib.util
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import child_env

optax = pytest.importorskip("optax")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_transformer.py")
STEPS = 20


def _load():
  spec = importlib.util.spec_from_file_location("train_transformer", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def tt():
  if len(jax.devices("cpu")) < 8:
    pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  return _load()


@pytest.fixture(scope="module")
def runs(tt):
  mesh = tt.make_mesh()
  return mesh, tt.train(mesh, STEPS, "dfccl"), tt.train(mesh, STEPS, "lax")


def test_losses_equal_the_jax_lax_version(runs):
  _, ours, ref = runs
  assert len(ours["losses"]) == len(ref["losses"]) == STEPS
  np.testing.assert_allclose(ours["losses"], ref["losses"], rtol=1e-5, atol=0)
  assert np.all(np.isfinite(ours["losses"]))
  assert np.mean(ours["losses"][-5:]) < np.mean(ours["losses"][:5]) - 0.2, ours["losses"]  # it learns
  # The parameters moved (every one of them: the experts and the router too) and agree.
  for k, v in ours["params"].items():
    assert not np.allclose(v, ours["params0"][k]), k
    np.testing.assert_allclose(v, ref["params"][k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_training_step_runs_on_jax_dfccl_only(tt, runs):
  """The jax_dfccl step compiles to jax_dfccl's custom calls and no XLA collective; the jax.lax
  step to XLA's collectives (so the comparison above compares two implementations)."""
  mesh = runs[0]
  counts = {}
  for lib in ("dfccl", "lax"):
    p0 = tt.init_params(tt.CONFIG, mesh.shape["model"])
    specs = tt.param_specs(p0)
    opt = optax.adam(1e-2)
    params = tt.place(mesh, p0, specs)
    state = jax.tree.map(lambda v: jax.device_put(v, NamedSharding(mesh, P()))
                         if not isinstance(v.sharding, NamedSharding) else v, opt.init(params))
    step = tt.make_train_step(mesh, tt.CONFIG, opt, specs, jax.tree.map(lambda v: v.sharding, (params, state)),
                              lib)
    x, y = (jax.device_put(a, NamedSharding(mesh, P(tt.ROWS))) for a in tt.batch(0, tt.CONFIG))
    hlo = step.lower(params, state, x, y).compile().as_text()
    counts[lib] = collections.Counter(
        re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", hlo)
        + re.findall(r'custom_call_target="(dfccl[^"]*)"', hlo))
  assert counts["dfccl"]["dfccl_start"] > 0 and counts["dfccl"]["dfccl_start"] == counts["dfccl"]["dfccl_done"]
  assert not any(k for k in counts["dfccl"] if not k.startswith("dfccl")), counts
  assert counts["lax"]["all-gather"] and counts["lax"]["reduce-scatter"] and counts["lax"]["all-reduce"], counts
  assert not any(k.startswith("dfccl") for k in counts["lax"]), counts


def test_plain_jit_evaluation_equals_the_training_loss(tt, runs):
  """The same model on global arrays from plain jax.jit (the overlap ops partitioning themselves)
  gives the loss the per-shard training step computed before its first update."""
  mesh, ours, _ = runs
  params = tt.place(mesh, ours["params0"], tt.param_specs(ours["params0"]))
  x, y = (jax.device_put(a, NamedSharding(mesh, P(tt.ROWS))) for a in tt.batch(0, tt.CONFIG))
  got = float(tt.make_eval(mesh, tt.CONFIG)(params, x, y))
  np.testing.assert_allclose(got, ours["losses"][0], rtol=1e-5)


def test_script_trains_and_plots(tmp_path):
  """The command line: a few steps, the progress bar on stderr and the loss plot written."""
  pytest.importorskip("matplotlib")
  png = tmp_path / "loss.png"
  p = subprocess.run([sys.executable, "-P", SCRIPT, "--steps", "4", "--plot", str(png)], env=child_env(8),
                     capture_output=True, text=True, timeout=240)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert re.search(r"\[#+\] 4/4 loss \d+\.\d+", p.stderr), p.stderr[-2000:]
  assert "held-out batch (plain jit)" in p.stdout, p.stdout
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
