"""JAX's own shard_map tests with jax_dfccl's collectives swapped in.

    python tools/jax_suite.py PATH [--only baseline|swapped] [--out DIR] [-k EXPR] [--baseline-xml FILE]

PATH is a JAX source checkout (its ``tests/shard_map_test.py`` is used), the
test file itself, or a bare git directory of the jax repository (the file is
read from ``HEAD``; ``--rev`` picks another revision).  The file is copied into
a scratch directory and run twice on 8 CPU devices, each in its own pytest
process: once with ``jax.lax`` (the baseline) and once inside
``jax_dfccl.patch_lax()`` (every collective ``jax.lax`` module attribute is
jax_dfccl's for the whole session).  Printed: the counts of both runs and the
*swapped-only* failures (pass with jax.lax, fail with ours), split into
unexpected ones and the expected differences listed in ``EXPECTED`` (tests that
look at what jax.lax emits rather than at what it computes); the exit status is
1 when an unexpected swapped-only failure remains.

The same module is the pytest plugin of the swapped run (``-p jax_suite``).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Tests whose swapped failure is by design, with the reason.  Keys are test
# names (the part after "::Class::"); a parametrised test is matched by the name
# before "[" or the parameter suffix as well.
_RGV3 = ("asserts XLA's native HLO text (the replica_group_mesh_axes attribute of jax.lax's collective, "
         "under config.use_rgv3); the values it checks first are right")
EXPECTED = {
    **dict.fromkeys(["test_all_gather_rgv3", "test_all_reduce_rgv3", "test_all_reduce_rgv3_multiple_meshes",
                     "test_all_to_all_rgv3", "test_reduce_scatter_rgv3_simple",
                     "test_reduce_scatter_rgv3_multidim_mesh",
                     "test_reduce_scatter_rgv3_multidim_mesh_tuple_sharding"], _RGV3),
    "test_rewrite_scan":
        "asserts the jaxpr's primitives are jax.lax's own (psum_invariant, pvary)",
    "test_shmap_unreduced_fsdp_grad":
        "asserts that the gradient's jaxpr holds jax.lax's own primitives "
        "('unreduced_reduce_scatter', 'unreduced_psum'); ours are dfccl_collective in modes "
        "'unreduced'/'reduced' (values and shardings: tests/test_lax_parity.py)",
    "test_ppermute_different_axis_order_error":
        "expects jax.lax's run-time refusal of axis_name=('y', 'x') against the mesh order ('x', 'y') "
        "(an XLA limitation); jax_dfccl runs it, ranks ordered as axis_name gives them (as axis_index)",
}


# ---------------------------------------------------------------- plugin side

_patch = None


def pytest_configure(config):  # the swapped run: jax.lax rebound for the session
  global _patch
  import jax_dfccl
  _patch = jax_dfccl.patch_lax()
  _patch.__enter__()


def pytest_unconfigure(config):
  if _patch is not None:
    _patch.__exit__(None, None, None)


# ---------------------------------------------------------------- runner side


def _test_file(path: pathlib.Path, rev: str) -> str:
  if path.is_file():
    return path.read_text()
  if (path / "tests" / "shard_map_test.py").is_file():
    return (path / "tests" / "shard_map_test.py").read_text()
  if (path / "HEAD").is_file() and (path / "objects").is_dir():  # a bare git directory
    return subprocess.run(["git", f"--git-dir={path}", "show", f"{rev}:tests/shard_map_test.py"],
                          check=True, capture_output=True, text=True).stdout
  raise SystemExit(f"jax_suite: {path} is neither a JAX checkout, nor its git dir, nor a test file")


def _results(xml: pathlib.Path) -> dict[str, str]:
  results = {}
  for case in ET.parse(xml).getroot().iter("testcase"):
    name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
    tags = {child.tag for child in case}
    results[name] = ("failed" if tags & {"failure", "error"} else
                     "skipped" if "skipped" in tags else "passed")
  return results


def _summary(label, results, log):
  print(f"{label}: " + ", ".join(
      f"{sum(v == s for v in results.values())} {s}" for s in ("passed", "failed", "skipped")), file=log)


def _run(work: pathlib.Path, swapped: bool, select: str | None, log) -> dict[str, str]:
  """Runs the copied test file; returns {test id: passed|failed|skipped}."""
  xml = work / ("swapped.xml" if swapped else "baseline.xml")
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(work / "pytest.ini"),
         "--rootdir", str(work), f"--junitxml={xml}", str(work / "shard_map_test.py")]
  if swapped:
    cmd[3:3] = ["-p", "jax_suite"]
  if select:
    cmd += ["-k", select]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tools"), str(ROOT),
                                                     os.environ.get("PYTHONPATH", "")]))
  with open(work / ("swapped.log" if swapped else "baseline.log"), "w") as f:
    subprocess.run(cmd, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT)
  results = _results(xml)
  _summary("swapped" if swapped else "baseline", results, log)
  return results


def expected_reason(test_id: str) -> str | None:
  name = test_id.split("::")[-1]
  for cand in (name, name.split("[")[0], name.rstrip("0123456789_")):
    if cand in EXPECTED:
      return EXPECTED[cand]
  return None


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("path", type=pathlib.Path)
  ap.add_argument("--rev", default="HEAD", help="revision, when PATH is a git directory")
  ap.add_argument("--only", choices=("baseline", "swapped"))
  ap.add_argument("-k", dest="select", help="pytest -k expression")
  ap.add_argument("--out", type=pathlib.Path, help="keep the logs and junit files here")
  ap.add_argument("--baseline-xml", type=pathlib.Path,
                  help="the junit file of an earlier baseline run (of the same file) instead of a new one")
  args = ap.parse_args(argv)
  work = args.out or pathlib.Path(tempfile.mkdtemp(prefix="jax_suite_"))
  work.mkdir(parents=True, exist_ok=True)
  (work / "shard_map_test.py").write_text(_test_file(args.path, args.rev))
  (work / "pytest.ini").write_text("[pytest]\n")  # not the checkout's (filterwarnings=error, ...)
  if args.baseline_xml:
    base = _results(args.baseline_xml)
    _summary("baseline (earlier run)", base, sys.stdout)
  else:
    base = {} if args.only == "swapped" else _run(work, False, args.select, sys.stdout)
  swap = {} if args.only == "baseline" else _run(work, True, args.select, sys.stdout)
  status = 0
  if base and swap:
    only = sorted(t for t, r in swap.items() if r == "failed" and base.get(t) == "passed")
    fixed = sorted(t for t, r in swap.items() if r == "passed" and base.get(t) == "failed")
    if fixed:
      print(f"pass only swapped: {len(fixed)}: " + ", ".join(fixed))
    unexpected = [t for t in only if expected_reason(t) is None]
    print(f"swapped-only failures: {len(only)} ({len(only) - len(unexpected)} expected, "
          f"{len(unexpected)} unexpected)")
    for t in only:
      reason = expected_reason(t)
      print(f"  {'expected  ' if reason else 'UNEXPECTED'} {t}" + (f"  -- {reason}" if reason else ""))
    status = 1 if unexpected else 0
  if args.out is None and status == 0:
    shutil.rmtree(work, ignore_errors=True)
  else:
    print(f"logs: {work}")
  return status


if __name__ == "__main__":
  sys.exit(main())
