"""Shared pieces of the GPU tests (imported by the test modules: ``from peers import needs_peers, ran``;
not a conftest.py, whose module name would shadow tests/conftest.py for the CPU tests).

- ``needs_peers``: the test needs >= 2 GPUs and is skipped with fewer.  On one GPU every group has
  one rank, and a group of one never reaches the runtime (it lowers to a reshape, ``core._trivial``),
  so a collective test there would pass whatever the runtime does.
- ``ran`` fixture: ``ran()`` is how many collectives the CUDA runtime started since the test
  began, so a test can assert that its collectives really went through the runtime (or, for a
  group of one, that they did not).
"""
from __future__ import annotations

import pytest

from jax_dfccl.testing import gpus

needs_peers = pytest.mark.skipif(
    len(gpus()) < 2, reason="needs >= 2 GPUs: with one, a group has one rank and the runtime never runs")

# The counter of stats()["cuda"] (xla_ffi/runtime/runtime.cc, Runtime::Stats) that grows with every
# collective task the runtime starts (one per device and collective), on the daemon and the copy
# engines alike (jax_dfccl._src.backend.STATS_KEYS).
STARTED_KEYS = ("started",)


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
