import os

# Eight CPU devices for the CPU backend tests (must be set before jax starts).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

# On GPUs, the test process takes device memory as it needs it instead of XLA's
# default 75% up front: the multi-process GPU tests start 2-4 more processes on
# the same GPU (each with its own fraction), also after other GPU tests ran here.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


def cpu_mesh(shape, names):
  devs = jax.devices("cpu")[: int(np.prod(shape))]
  return Mesh(np.array(devs).reshape(shape), names)


@pytest.fixture(scope="session")
def mesh8():
  return cpu_mesh((8,), ("x",))


@pytest.fixture(scope="session")
def mesh24():
  return cpu_mesh((2, 4), ("x", "y"))


def put(x, mesh, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


def child_env(devices: int) -> dict:
  """The environment of a child Python on `devices` CPU devices that imports the jax_dfccl this
  process imported (an installed package, a source tree, a link farm) before anything else."""
  import jax_dfccl
  where = os.path.dirname(os.path.dirname(os.path.abspath(jax_dfccl.__file__)))
  return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
          "PYTHONPATH": os.pathsep.join([where, os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(autouse=True)
def _reset_dfccl_config():
  import jax_dfccl
  saved = jax_dfccl.config.as_dict()
  yield
  now = jax_dfccl.config.as_dict()
  changed = {k: v for k, v in saved.items() if now[k] != v}
  if changed:
    jax_dfccl.configure(**changed)


def pytest_addoption(parser):
  parser.addoption("--jax-checkout", default=None,
                   help="a jax source checkout (or its tests/shard_map_test.py, or its git dir): "
                        "tests/test_jax_suite.py runs JAX's shard_map tests with our collectives swapped in")
