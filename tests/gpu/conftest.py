"""Shared pieces of the GPU tests.

- ``@pytest.mark.needs_peers``: the test needs >= 2 GPUs and is skipped with fewer.  On one GPU
  every group has one rank, and a group of one never reaches the runtime (it lowers to a reshape,
  ``core._trivial``), so a collective test there would pass whatever the runtime does.
- ``ran`` fixture: ``ran()`` is how many collectives the CUDA runtime started since the test
  began, so a test can assert that its collectives really went through the runtime (or, for a
  group of one, that they did not).
"""
from __future__ import annotations

import pytest

from jax_dfccl.testing import gpus


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "needs_peers: needs >= 2 GPUs (on one GPU every group has one rank and never reaches "
      "the runtime); skipped otherwise")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  if item.get_closest_marker("needs_peers") is not None and len(gpus()) < 2:
    pytest.skip(f"needs >= 2 GPUs ({len(gpus())} here): with one, a group has one rank and the runtime never runs")


# The counters of stats()["cuda"] (xla_ffi/runtime/runtime.cc, Runtime::Stats) that grow with every
# collective the runtime starts: daemon tickets (one per device and collective) and instances moved
# by the copy engines (one per collective, all ranks together; they take no daemon ticket).
STARTED_KEYS = ("collectives_started", "copy_engine_ops")


def _started() -> int:
  import jax_dfccl
  s = jax_dfccl.stats()["cuda"]
  return int(sum(s[k] for k in STARTED_KEYS))


@pytest.fixture
def ran():
  """``ran()``: collectives the CUDA runtime started since the test began (daemon tickets, one per
  device, plus copy-engine instances)."""
  before = _started()
  return lambda: _started() - before
