"""The notebooks execute on CPU (8 forced devices)."""
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(path, as_version=4)
  env_flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  try:
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
  finally:
    os.environ["XLA_FLAGS"] = env_flags
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors, errors
