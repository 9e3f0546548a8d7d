"""The contracts every backend shares, checked on the CPU backend (the CUDA
backend: tests/gpu/test_gpu_contract.py): the runtime holds exactly the
configuration Python set (jax_dfccl/config.py is the one schema), stats() has
exactly the documented keys, and errors carry their kind as XLA's error code."""
import dataclasses
import pathlib
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_dfccl as dc
from jax_dfccl._src import backend
from jax_dfccl.config import DEFAULTS, FLAT, TYPES, Config, Overlap, TestHooks, Tuning

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The entries the CPU runtime reads (xla_ffi/cpu/config.h DFCCL_CPU_CONFIG).
CPU_ENTRIES = {"timeout_s", "spin_budget_us", "sticky_budget_us", "trace", "trace_capacity", "fault_device",
               "fault_start_delay_us", "fault_compute_delay_us"}


def _cpu():
  return backend.load()["cpu"]


def test_cpu_runtime_holds_the_python_defaults():
  got = _cpu().config()
  assert set(got) == CPU_ENTRIES
  want = DEFAULTS  # the defaults, as defined once in Python
  for k, v in got.items():
    assert v == want[k] or v == dc.config.as_dict()[k], k
    assert type(v) is type(want[k]), (k, type(v))


def test_cpu_runtime_reports_exactly_what_python_set():
  new = {"timeout_s": 123.25, "spin_budget_us": 3.5, "sticky_budget_us": 77.0, "trace": True,
         "trace_capacity": 1234, "fault_device": 3, "fault_start_delay_us": 1.5, "fault_compute_delay_us": 2.0}
  with dc.configured(**new):
    got = _cpu().config()
    assert got == {k: dc.config.as_dict()[k] for k in CPU_ENTRIES} == new
  got = _cpu().config()
  assert got == {k: dc.config.as_dict()[k] for k in CPU_ENTRIES}


def test_rejected_value_changes_nothing():
  before, rt_before = dc.config.as_dict(), _cpu().config()
  with pytest.raises(ValueError, match="trace_capacity"):
    dc.configure(timeout_s=42.0, trace_capacity=0)
  assert dc.config.as_dict() == before and _cpu().config() == rt_before


def test_python_config_is_the_only_default_list():
  """Every entry is documented in config.py (a #: comment above it)."""
  src = (ROOT / "jax_dfccl" / "config.py").read_text()
  for f in (f for cls in (Config, Tuning, Overlap, TestHooks) for f in dataclasses.fields(cls)):
    assert re.search(r"#:[^\n]*\n(?:\s*#:[^\n]*\n|\s*\w+: [^\n]*\n)*\s*" + f.name + ":", src), f.name
  # No competing defaults in the runtimes' config structs.
  for path in ("xla_ffi/runtime/config.h", "xla_ffi/cpu/config.h", "xla_ffi/cpu/runtime.h"):
    text = (ROOT / path).read_text()
    assert "kCyclesPerUs" not in text
    for name in ("timeout_s", "idle_quit_us", "stall_quit_us", "spin_budget_us"):
      assert not re.search(name + r"\s*(\{[^}]|=)\s*[0-9]", text), (path, name)


def _doc_table():
  """The key column of the "stats() keys" table in docs/architecture.md."""
  doc = (ROOT / "docs" / "architecture.md").read_text()
  section = doc.split("### stats() keys", 1)[1].split("\n#", 1)[0]
  common = re.findall(r"^\| `(\w+)` \|", section.split("Backend extras", 1)[0], re.M)
  extras = {}
  for plat, body in re.findall(r"^- `(\w+)`: (.*)$", section.split("Backend extras", 1)[1], re.M):
    extras[plat] = set(re.findall(r"`(\w+)`", body))
  return common, extras


def test_stats_keys_are_the_documented_table(mesh8):
  common, extras = _doc_table()
  assert common == list(backend.STATS_KEYS)
  assert extras == {p: set(e) for p, e in backend.STATS_EXTRAS.items()}
  jax.block_until_ready(jax.jit(jax.shard_map(lambda v: dc.psum(v, "x"), mesh=mesh8, in_specs=P("x"),
                                              out_specs=P("x")))(np.arange(8.0, dtype=np.float32)))
  s = dc.stats()["cpu"]
  assert set(s) == set(backend.STATS_KEYS) | set(backend.STATS_EXTRAS["cpu"])
  assert isinstance(s["errors"], list) and all(isinstance(s[k], int) for k in s if k != "errors")
  assert s["pending"] == s["started"] - s["completed"] - s["failed"]
  assert s["started"] >= 8 and s["communicators"] >= 1


def test_timeout_is_deadline_exceeded_and_recorded(mesh8):
  """A timed-out collective fails with XLA's DEADLINE_EXCEEDED, names key and missing ranks, and
  its message is in stats()['errors']."""
  dc.reset()
  body = lambda v: jax.lax.cond(jax.lax.axis_index("x") == 0, lambda v: dc.psum(v, "x", key="contract/lonely"),
                                lambda v: v, v)
  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh8, P("x")))
  with dc.configured(timeout_s=0.3):
    with pytest.raises(Exception, match=r"DEADLINE_EXCEEDED.*contract/lonely.*never started"):
      jax.block_until_ready(f(x))
  try:
    jax.effects_barrier()
  except Exception:  # noqa: BLE001 - the failed program's other devices
    pass
  errs = dc.stats()["cpu"]["errors"]
  assert any("contract/lonely" in e and "[1 (device" in e for e in errs), errs
  dc.raise_if_failed()  # on CPU the failed program raised it itself: nothing left to raise
  dc.reset()
  assert dc.stats()["cpu"]["errors"] == []


def test_mismatch_is_failed_precondition(mesh8):
  dc.reset()
  def body(v):
    return jax.lax.cond(jax.lax.axis_index("x") == 0, lambda v: dc.psum(v, "x", key="contract/mm"),
                        lambda v: dc.pmax(v, "x", key="contract/mm"), v)
  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh8, P("x")))
  with pytest.raises(Exception, match=r"FAILED_PRECONDITION.*contract/mm.*mismatch"):
    jax.block_until_ready(f(x))
  try:
    jax.effects_barrier()
  except Exception:  # noqa: BLE001
    pass
  dc.reset()


def _table(path, macro):
  """(type, name) rows of an X-macro config table of a runtime header."""
  text = (ROOT / path).read_text()
  body = text.split(f"#define {macro}(X)", 1)[1].split("\n\n", 1)[0]
  return re.findall(r"X\((\w+), (\w+)\)", body)


@pytest.mark.parametrize("path,macro", [("xla_ffi/cpu/config.h", "DFCCL_CPU_CONFIG"),
                                        ("xla_ffi/runtime/config.h", "DFCCL_GPU_CONFIG")])
def test_runtime_tables_are_entries_of_the_python_schema(path, macro):
  """Both runtimes' tables (the CUDA one too, checked here without a GPU) hold entries of
  jax_dfccl.config, under its names and with its types."""
  rows = _table(path, macro)
  assert len(rows) >= 5
  fields = {k: getattr(t, "__name__", str(t)) for k, t in TYPES.items()}
  py = {"double": "float", "int": "int", "int64_t": "int", "bool": "bool"}
  for ctype, name in rows:
    assert name in fields, f"{path}: {name} is not an entry of jax_dfccl.config"
    assert py[ctype] == fields[name], (name, ctype, fields[name])


def test_every_gpu_entry_reaches_the_gpu_runtime():
  """The GPU-only entries of the schema (neither the CPU runtime's nor read at trace time) are in
  the CUDA runtime's table."""
  gpu = {n for _, n in _table("xla_ffi/runtime/config.h", "DFCCL_GPU_CONFIG")}
  cpu = {n for _, n in _table("xla_ffi/cpu/config.h", "DFCCL_CPU_CONFIG")}
  assert cpu == CPU_ENTRIES
  from jax_dfccl.config import CPU_ONLY_ENTRIES, INIT_ENTRIES, TRACE_TIME_ENTRIES
  assert set(FLAT) - gpu == CPU_ONLY_ENTRIES | TRACE_TIME_ENTRIES | INIT_ENTRIES


_UNCONFIGURED = """
import sys
sys.path.insert(0, {cpp!r})
import numpy as np, jax
from jax.sharding import Mesh
import test_cpu_runtime as T   # drives _dfccl_cpu directly, without jax_dfccl._src.backend
T._register()
mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("x",))
print("CONFIG", T.rt.config(), flush=True)
try:
  T._run(mesh, lambda v: T._done(T._start(v, T._pid(), mesh, "all_reduce", "u"), "u"), np.arange(8, dtype=np.float32))
  print("RAN", flush=True)
except Exception as e:  # noqa: BLE001
  print("ERROR", e, flush=True)
"""


def test_unconfigured_runtime_runs_nothing():
  """A runtime given no configuration holds no values of its own and refuses to start."""
  import subprocess
  import sys
  from conftest import child_env
  # The child imports the jax_dfccl this process imported (-P: not a source tree in the cwd).
  p = subprocess.run([sys.executable, "-P", "-c", _UNCONFIGURED.format(cpp=str(ROOT / "tests" / "cpp"))],
                     capture_output=True, text=True, timeout=120, env=child_env(8))
  out = p.stdout + p.stderr
  assert "CONFIG {" in p.stdout and "RAN" not in p.stdout, out
  config_line = next(line for line in p.stdout.splitlines() if line.startswith("CONFIG"))
  assert "'timeout_s': 0.0" in config_line and "'trace_capacity': 0" in config_line, config_line
  assert "FAILED_PRECONDITION" in out and "not configured" in out, out


MODULE_FUNCTIONS = ("op_table", "registrations", "configure", "config", "stats", "trace_records", "pending",
                    "raise_if_failed", "reset")


def test_both_modules_export_the_contract_functions():
  """docs/architecture.md "Extension-module contract": the functions both modules export."""
  import importlib
  doc = (ROOT / "docs/architecture.md").read_text()
  table = doc[doc.index("## Extension-module contract"):]
  table = table[:table.index("\n## ", 4)]
  assert set(re.findall(r"^\| `(\w+)\(", table, re.M)) == set(MODULE_FUNCTIONS)
  for name in ("jax_dfccl._dfccl_cpu", "jax_dfccl._dfccl_cuda"):
    try:
      m = importlib.import_module(name)
    except ImportError:
      continue
    assert all(callable(getattr(m, f, None)) for f in MODULE_FUNCTIONS), name


def test_cuda_module_functions_called_from_threads_at_once():
  """The CUDA module's functions that take the runtime's lock run in the runtime without the GIL
  (xla_ffi/bindings/cuda_module.cc) and make their Python results with it: called from several
  Python threads at once (no GPU), they neither crash nor deadlock nor disagree — every thread sees
  the configuration Python set, the documented stats() keys, and the copy-engine choice the
  configuration implies."""
  import importlib
  import threading
  try:
    m = importlib.import_module("jax_dfccl._dfccl_cuda")
  except ImportError:
    pytest.skip("the CUDA backend is not built")
  cfg = dict(dc.config.as_dict(), copy_engine_min_bytes=1 << 20, copy_engine_reduce_min_bytes=1 << 22)
  m.configure(cfg)
  ag = m.op_table()["ops"]["all_gather"][0]
  want_keys = set(backend.STATS_KEYS) | set(backend.STATS_EXTRAS["cuda"])
  errors, got = [], []

  def worker():
    try:
      for _ in range(200):
        c = m.config()
        s = m.stats()
        got.append((c["copy_engine_min_bytes"], set(s) == want_keys, m.uses_copy_engine(ag, 2, 1 << 21, 1 << 22),
                    m.uses_copy_engine(ag, 2, 1 << 10, 1 << 11), m.uses_copy_engine(ag, 1, 1 << 21, 1 << 22)))
        m.configure(cfg)
        assert isinstance(m.trace_records(), list)
    except Exception as e:  # noqa: BLE001
      errors.append(repr(e))
  threads = [threading.Thread(target=worker) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert not any(t.is_alive() for t in threads), "a module function deadlocked"
  assert not errors, errors[:3]
  assert len(got) == 800
  # 4 MiB out per rank >= 1 MiB: copy engines (2 ranks); 2 KiB: the daemon; a group of one never.
  assert set(got) == {(1 << 20, True, True, False, False)}
  m.configure(dc.config.as_dict())


def test_cuda_module_contract_without_a_gpu():
  """The CUDA extension (when built) loads without a GPU: its config() reports exactly what Python
  set, rejects a value out of range without changing anything, and its stats() keys are the
  documented table (the same checks on GPUs: tests/gpu/test_gpu_contract.py)."""
  import importlib
  try:
    m = importlib.import_module("jax_dfccl._dfccl_cuda")
  except ImportError:
    pytest.skip("the CUDA backend is not built")
  want = dict(DEFAULTS)
  m.configure(want)
  got = m.config()
  assert {k: (v, type(v)) for k, v in got.items()} == {k: (want[k], type(want[k])) for k in got}
  gpu = {n for _, n in _table("xla_ffi/runtime/config.h", "DFCCL_GPU_CONFIG")}
  assert set(got) == gpu
  with pytest.raises(ValueError, match="max_blocks"):
    m.configure({"timeout_s": 1.0, "max_blocks": 65})
  assert m.config() == got
  s = m.stats()
  # The module's own keys are the documented table (the fused ops' overlap_channels included).
  assert set(s) == set(backend.STATS_KEYS) | set(backend.STATS_EXTRAS["cuda"])
  assert s["overlap_channels"] == 0
  m.raise_if_failed()  # no GPU: no device, nothing recorded
  m.configure(dc.config.as_dict())


def test_cuda_module_targets_and_their_state_type():
  """The CUDA module's FFI table: the targets core.py lowers to, each a handler or a dict of XLA's
  stages; the starts of groups spanning processes (`_x`) have an instantiate stage (their
  attributes decoded once per executable into a state) and an initialize stage, and that state's
  type is in types() with the id and info XLA's type registration takes (backend.py registers it
  before the targets)."""
  import importlib
  try:
    m = importlib.import_module("jax_dfccl._dfccl_cuda")
  except ImportError:
    pytest.skip("the CUDA backend is not built")
  regs = m.registrations()
  # The fused overlap ops' targets are there when the module was built with them (CUTLASS).
  fused = {"dfccl_overlap_ag", "dfccl_overlap_rs"} if m.has_overlap else set()
  assert set(regs) == {f"dfccl_{n}{s}" for n in ("start", "done", "collective") for s in ("", "_host")} | {
      "dfccl_start_x", "dfccl_collective_x"} | fused
  for name in ("dfccl_start_x", "dfccl_collective_x"):
    assert set(regs[name]) == {"instantiate", "initialize", "execute"}, name
  types = m.types()
  assert set(types) == {"dfccl_x_site"} and set(types["dfccl_x_site"]) == {"type_id", "type_info"}


def test_assigning_an_entry_takes_effect_in_the_runtime():
  """``jax_dfccl.config.<entry> = value`` reaches the loaded runtime at once (a collective one rank
  never starts fails after the new timeout_s, not the old one); a rejected value raises and changes
  nothing; an unknown name raises instead of being kept by Python alone."""
  import time
  import jax
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P
  old = dc.config.timeout_s
  _cpu()
  try:
    dc.config.timeout_s = 1.5
    assert _cpu().config()["timeout_s"] == 1.5 and dc.config.as_dict()["timeout_s"] == 1.5
    dc.config.tuning.spin_budget_us = 7.0
    assert _cpu().config()["spin_budget_us"] == 7.0
    before = (dc.config.as_dict(), _cpu().config())
    with pytest.raises(ValueError, match="trace_capacity"):
      dc.config.trace_capacity = 0
    with pytest.raises(AttributeError, match="timout_s"):
      dc.config.timout_s = 2.0
    with pytest.raises(AttributeError, match="small_slot"):
      dc.config.tuning.small_slot = 3
    assert (dc.config.as_dict(), _cpu().config()) == before
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

    def body(v):  # rank 1 never starts 'late'
      return jax.lax.cond(jax.lax.axis_index("x") == 0, lambda u: dc.psum(u, "x", key="late"), lambda u: u, v)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    t0 = time.monotonic()
    with pytest.raises(Exception, match="DEADLINE_EXCEEDED.*'late'"):
      f(np.ones((2, 4), np.float32)).block_until_ready()
    assert time.monotonic() - t0 < 1.5 + 3.0
    try:
      jax.effects_barrier()
    except Exception:  # noqa: BLE001 - the failed program's other devices
      pass
  finally:
    dc.config.timeout_s = old
    dc.config.tuning.spin_budget_us = DEFAULTS["spin_budget_us"]
    dc.reset()


def test_config_sections_are_documented_namespaces():
  """User settings apart from tuning, overlap switches and test hooks; every entry has one flat
  name (the runtimes') and one place."""
  assert set(FLAT) == set(DEFAULTS) == set(TYPES)
  user = {f for f, (path, _) in FLAT.items() if path == ""}
  assert user == {"timeout_s", "trace", "trace_capacity", "shm_arena_bytes", "shm_max_instances",
                  "cross_host_transport", "cross_host_region_bytes", "lost_after_s"}
  assert {f for f, (path, _) in FLAT.items() if path == "testing"} >= {"fault_device", "runtime_for_groups_of_one"}
  assert all(f.startswith("overlap_") for f, (path, _) in FLAT.items() if path == "overlap")
  assert dc.config.overlap.tile_n == DEFAULTS["overlap_tile_n"]
