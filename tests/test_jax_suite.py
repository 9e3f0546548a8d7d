"""JAX's own shard_map tests with jax_dfccl's collectives swapped in (tools/jax_suite.py).

Needs a jax source checkout: ``pytest tests/test_jax_suite.py --jax-checkout PATH`` (and
absl-py); skipped otherwise, e.g. in CI, which cannot fetch one.  The behaviours the suite
found are tested on their own in test_lax_parity.py, test_partial_manual.py,
test_dtypes.py, test_patch_lax.py and test_overlap.py."""
import importlib.util
import pathlib

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "jax_suite.py"


def _tool():
  spec = importlib.util.spec_from_file_location("jax_suite", TOOL)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_expected_differences_have_reasons():
  tool = _tool()
  assert tool.EXPECTED and all(isinstance(r, str) and len(r) > 10 for r in tool.EXPECTED.values())
  assert tool.expected_reason("ShardMapTest::test_shmap_unreduced_fsdp_grad") is not None
  assert tool.expected_reason("ShardMapTest::test_psum") is None


@pytest.mark.slow
def test_no_unexpected_swapped_only_failures(request, tmp_path):
  path = request.config.getoption("--jax-checkout")
  if not path:
    pytest.skip("no jax checkout given (--jax-checkout PATH)")
  pytest.importorskip("absl")
  assert _tool().main([path, "--out", str(tmp_path)]) == 0, (tmp_path / "swapped.log").read_text()[-5000:]
