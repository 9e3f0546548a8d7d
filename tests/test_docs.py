"""The documentation: the Sphinx build passes with warnings as errors (and fails on one), every
public name is in the API reference, the configuration reference is generated from config.py
(flat or in sections), the performance plots are made from the results, and the results index
names every result file in one short line."""
import dataclasses
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"


def _need_sphinx():
  pytest.importorskip("sphinx")
  pytest.importorskip("myst_nb")


def _docs_copy(tmp_path) -> pathlib.Path:
  """docs/ and notebooks/ copied side by side (the build never writes into the source tree)."""
  shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("_build", "notebooks"))
  shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks")
  (tmp_path / "README.md").write_text((ROOT / "README.md").read_text())
  return tmp_path / "docs"


def _build(src: pathlib.Path, out: pathlib.Path) -> subprocess.CompletedProcess:
  # -W: warnings are errors; -P: the jax_dfccl these tests import (child_env), not a source tree.
  return subprocess.run([sys.executable, "-P", "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                         str(src), str(out)], env=child_env(8), capture_output=True, text=True, timeout=600)


def test_docs_build_with_warnings_as_errors(tmp_path):
  _need_sphinx()
  import jax_dfccl
  proc = _build(_docs_copy(tmp_path), tmp_path / "html")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  html = tmp_path / "html"
  for page in ("index", "api", "performance", "limitations", "architecture", "guides/order_free",
               "guides/multiprocess", "guides/overlap", "guides/debugging", "guides/configuration",
               "guides/installation", "design/contract", "design/identity", "design/cpu", "design/gpu",
               "design/overlap", "design/scale-out"):
    assert (html / f"{page}.html").exists(), page
  # The API reference documents every public name (autodoc imported the package).
  api = (html / "api.html").read_text()
  for name in jax_dfccl.__all__:
    if name != "config":
      assert f'id="jax_dfccl.{name}"' in api, name
  # The configuration reference has every entry, generated from config.py.
  conf = (html / "guides" / "configuration.html").read_text()
  for name in _entry_names(type(jax_dfccl.config)):
    assert name in conf, name
  # The notebooks are rendered with their stored outputs (not executed at build time).
  nb = (html / "notebooks" / "01_quickstart.html").read_text()
  assert "max |difference| vs jax.lax" in nb and "cell_output" in nb
  # The README's quickstart is included in the installation guide.
  assert "threading" in (html / "guides" / "installation.html").read_text()


def test_docs_build_fails_on_a_warning(tmp_path):
  _need_sphinx()
  src = _docs_copy(tmp_path)
  (src / "stray.md").write_text("# A page in no table of contents\n\nSee {doc}`no-such-page`.\n")
  proc = _build(src, tmp_path / "html")
  assert proc.returncode != 0
  assert "no-such-page" in proc.stderr or "toc.not_included" in proc.stderr, proc.stderr


def test_api_reference_names_every_export():
  import jax_dfccl
  api = (DOCS / "api.md").read_text()
  missing = [n for n in jax_dfccl.__all__ if n != "config" and not re.search(rf"jax_dfccl\.{n}\b", api)]
  assert not missing, missing


def _entry_names(cls, prefix=""):
  for f in dataclasses.fields(cls):
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    if dataclasses.is_dataclass(default):
      yield from _entry_names(type(default), f"{prefix}{f.name}.")
    else:
      yield prefix + f.name


def _generator():
  sys.path.insert(0, str(DOCS / "_ext"))
  try:
    import dfccl_config_doc
  finally:
    sys.path.remove(str(DOCS / "_ext"))
  return dfccl_config_doc


def test_config_reference_has_every_entry_with_its_comment():
  _need_sphinx()
  import jax_dfccl
  gen = _generator()
  text = gen.config_markdown()
  for name in _entry_names(type(jax_dfccl.config)):
    assert f"`{name}`" in text, name
  assert "`timeout_s` (float, default `300.0`)" in text
  assert "fails with an error naming the key" in text  # the #: comment above timeout_s


def test_config_reference_recurses_into_sections(tmp_path):
  """A configuration split into sections (fields whose default is a config dataclass): a heading
  per section with its docstring, the entries under their dotted names, the comments kept."""
  _need_sphinx()
  (tmp_path / "fake_sections_config.py").write_text(textwrap.dedent('''
      import dataclasses

      @dataclasses.dataclass
      class Gpu:
        """GPU tuning."""
        _prefix = ""
        #: Thread blocks of the daemon.
        max_blocks: int = 16
        lanes: int = 4
        #: Staging bytes per lane.
        chunk_bytes: int = 1 << 20

      @dataclasses.dataclass
      class Config:
        #: Seconds before a collective fails.
        timeout_s: float = 300.0
        #: What a GPU runtime reads.
        gpu: Gpu = dataclasses.field(default_factory=Gpu)

      config = Config()
      '''))
  spec = importlib.util.spec_from_file_location("fake_sections_config", tmp_path / "fake_sections_config.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules["fake_sections_config"] = module
  try:
    spec.loader.exec_module(module)
    text = _generator().entries_markdown(module.Config, module)
  finally:
    del sys.modules["fake_sections_config"]
  assert "`timeout_s` (float, default `300.0`)\n: Seconds before a collective fails." in text
  assert "## `config.gpu`\n\nGPU tuning." in text
  # A section's entries under dotted names, with the flat name configure() takes; an entry without
  # a comment is listed with the documented one before it.
  assert ("`gpu.max_blocks` (int, default `16`; `configure(max_blocks=...)`), "
          "`gpu.lanes` (int, default `4`; `configure(lanes=...)`)\n: Thread blocks of the daemon.") in text
  assert ("`gpu.chunk_bytes` (int, default `1048576` (1 MiB); `configure(chunk_bytes=...)`)\n"
          ": Staging bytes per lane.") in text


def test_performance_plots_are_made_from_the_results(tmp_path):
  pytest.importorskip("matplotlib")
  spec = importlib.util.spec_from_file_location("plots", ROOT / "benchmarks" / "plots.py")
  plots = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(plots)
  first = plots.main(["--out", str(tmp_path / "a")])
  second = plots.main(["--out", str(tmp_path / "b")])
  perf = (DOCS / "performance.md").read_text()
  assert {p.name for p in first} == set(plots.SOURCES)
  for a, b in zip(first, second):
    assert a.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert a.read_bytes() == b.read_bytes(), a.name  # deterministic
    assert f"images/performance/{a.name}" in perf, a.name  # shown in docs/performance.md
    assert (DOCS / "images" / "performance" / a.name).exists(), a.name  # and committed
  for files in plots.SOURCES.values():
    for f in files:
      assert (RESULTS / f).exists(), f


def _expand(pattern: str) -> list[str]:
  """`a_{x,y}.{json,md}` -> the names it stands for (brace groups, as a shell expands them)."""
  m = re.search(r"\{([^{}]*)\}", pattern)
  if not m:
    return [pattern]
  return [n for alt in m.group(1).split(",")
          for n in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def test_results_index_has_one_short_line_per_file():
  index = (RESULTS / "README.md").read_text()
  rows = [l for l in index.splitlines() if l.startswith("- `")]
  assert rows
  named = set()
  for row in rows:
    assert len(row) <= 150, row
    named.update(_expand(row[3:row.index("`", 3)]))
  files = {p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md"}
  files |= {p.name for p in (RESULTS / "logs").iterdir() if p.is_file()}
  assert files - named == set()  # every file has its line
  assert named - files == set()  # and every line names files that exist
