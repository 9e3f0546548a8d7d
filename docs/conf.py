"""Sphinx configuration of the jax_dfccl documentation.

Build: ``sphinx-build -W docs docs/_build/html`` with the package installed (the API reference
imports it).  Pages are MyST Markdown; the notebooks of ``notebooks/`` are copied into
``docs/notebooks/`` at build time and rendered with their stored outputs (never executed);
the configuration reference is generated from ``jax_dfccl/config.py`` (``_ext/dfccl_config_doc.py``).
"""
import pathlib
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "jax_dfccl"
author = "the jax_dfccl authors"
copyright = "the jax_dfccl authors; Apache License 2.0"
try:
  import jax_dfccl
  release = version = jax_dfccl.__version__
except ImportError:  # the API reference then fails loudly; the rest builds
  release = version = ""

extensions = [
    "myst_nb",                    # MyST Markdown pages and .ipynb notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",        # Google-style docstrings (Args, Returns, Raises, Example)
    "sphinx.ext.viewcode",
    "dfccl_config_doc",           # the configuration reference, generated from config.py
]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
myst_enable_extensions = ["colon_fence", "deflist", "attrs_inline"]
myst_heading_anchors = 3
nb_execution_mode = "off"         # the notebooks are rendered as stored (tests/test_notebooks.py runs them)
exclude_patterns = ["_build", "README.md", "**/.ipynb_checkpoints"]
suppress_warnings = ["mystnb.unknown_mime_type"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_static_path = []
html_title = "jax_dfccl"


def _copy_notebooks():
  """notebooks/*.ipynb -> docs/notebooks/ (Sphinx reads only files under its source folder)."""
  dest = DOCS / "notebooks"
  dest.mkdir(exist_ok=True)
  for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
    target = dest / nb.name
    if not target.exists() or target.read_bytes() != nb.read_bytes():
      shutil.copyfile(nb, target)


_copy_notebooks()  # at configuration time: before Sphinx looks for its source files
