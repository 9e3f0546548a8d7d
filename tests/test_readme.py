"""The README: its quickstart runs as written and prints what it says; its set-up and test
commands are the ones CI runs; it stays short and its links lead somewhere."""
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np

from conftest import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
  body = README.split(f"\n## {title}\n", 1)[1]
  return body.split("\n## ", 1)[0]


def _blocks(text: str, lang: str) -> list[str]:
  return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


# Runs the quickstart in a fresh Python (as a user would: no XLA_FLAGS, outside the source
# tree), then computes the same two results with jax.lax on the quickstart's own mesh and
# writes everything to a JSON file for the test to compare.
DRIVER = r"""
import json, sys
ns = {"__name__": "__main__"}
exec(compile(open(sys.argv[1]).read(), "quickstart.py", "exec"), ns)
import jax, numpy as np
from jax.sharding import PartitionSpec as P
def ref(x, y):   # jax.lax, every rank in the same order
  return jax.lax.psum(x, "x"), jax.lax.all_gather(y, "x", tiled=True)
lax_a, lax_b = jax.jit(jax.shard_map(ref, mesh=ns["mesh"], in_specs=(P("x"), P("x")),
                                     out_specs=(P("x"), P("x")), check_vma=False))(ns["x"], 10 * ns["x"])
json.dump({k: np.asarray(v).tolist() for k, v in
           dict(x=ns["x"], a=ns["a"], b=ns["b"], lax_a=lax_a, lax_b=lax_b).items()},
          open(sys.argv[2], "w"))
"""


def test_quickstart_runs_and_prints_what_it_says(tmp_path):
  (code,) = _blocks(_section("Quickstart"), "python")
  (tmp_path / "quickstart.py").write_text(code)
  (tmp_path / "driver.py").write_text(DRIVER)
  env = child_env(4)
  env.pop("XLA_FLAGS")  # the quickstart sets its own device count
  proc = subprocess.run([sys.executable, "-P", "driver.py", "quickstart.py", "out.json"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  out = json.loads((tmp_path / "out.json").read_text())
  x = np.asarray(out["x"])
  # psum: every rank holds the sum of the 4 shards; all_gather: every rank holds all of 10 * x.
  np.testing.assert_array_equal(out["a"], np.tile(x.reshape(4, 2).sum(0), 4))
  np.testing.assert_array_equal(out["b"], np.tile(10 * x, 4))
  np.testing.assert_array_equal(out["a"], out["lax_a"])
  np.testing.assert_array_equal(out["b"], out["lax_b"])
  assert np.asarray(out["a"]).reshape(4, 2)[0].tolist() == [12.0, 16.0]  # the comment's values
  stdout = proc.stdout
  assert "no collective in flight" in stdout
  # pending(), from the timer's thread while ranks 0-2 wait: the stuck key and who is missing.
  stuck = [l for l in stdout.splitlines() if "'stuck' seq 0" in l]
  assert stuck and "not by [3 (device 3)]" in stuck[0], stdout
  assert "started by rank(s) [0 (device 0), 1 (device 1), 2 (device 2)]" in stuck[0], stdout
  # The error: DEADLINE_EXCEEDED naming the key and the rank that never started it.
  err = [l for l in stdout.splitlines() if l.startswith("DEADLINE_EXCEEDED")]
  assert err and "'stuck'" in err[0] and "ranks [3 (device 3)] never started it" in err[0], stdout
  assert "Traceback" not in proc.stderr, proc.stderr


def test_setup_and_test_commands_are_what_ci_runs():
  setup, tests = _blocks(_section("Installation"), "bash")
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  for command in (setup.strip(), tests.strip()):
    assert command in ci, command  # a line of .ci/run, verbatim
  # A fresh machine's commands: no machine-specific Python selection.
  assert "PYENV" not in setup and setup.startswith("python3.12 -m venv .venv")


def test_readme_is_short_and_its_links_exist():
  assert len(README.splitlines()) <= 200
  links = re.findall(r"\]\(([^)#][^)]*)\)", README)
  assert links
  for link in links:
    if "://" in link:
      continue
    assert (ROOT / link.split("#")[0]).exists(), link
  # Limitations: at most 6 bullets, and the full list is linked.
  bullets = [l for l in _section("Status and limitations").splitlines() if l.startswith("- ")]
  assert 1 <= len(bullets) <= 6
  assert "docs/limitations.md" in _section("Status and limitations")
