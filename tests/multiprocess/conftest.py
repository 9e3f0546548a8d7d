import pytest

from harness import LAUNCHED, shm_segments


@pytest.fixture(scope="session", autouse=True)
def no_leaks():
  """After the suite: no shared-memory segment and no process of ours left."""
  before = shm_segments()
  yield
  alive = [p.pid for p in LAUNCHED if p.poll() is None]
  left = [s for s in shm_segments() if s not in before]
  assert not alive, f"processes left behind: {alive}"
  assert not left, f"shared-memory segments left behind: {left}"
