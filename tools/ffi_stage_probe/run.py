"""Which stages of an XLA FFI handler does XLA call per execution, inside and outside its command
buffers, and does a write that the initialize stage enqueues reach the replayed kernels of the same
execution?  (docs/design/execution_identity.md, "Inside command buffers: the plan".)

    python3 tools/ffi_stage_probe/run.py --out result.json             # both modes, each in a fresh process
    python3 tools/ffi_stage_probe/run.py --mode on --executions 20     # one mode, in this process

Builds tools/ffi_stage_probe/probe.cu with nvcc against jaxlib's FFI headers (into
tools/ffi_stage_probe/build/), registers its target `probe_stages` (prepare, initialize and a
command-buffer compatible execute stage), and runs a jitted program of K calls of it, each between
two element-wise ops (so XLA builds a command buffer around them), N times with its input donated
(XLA replays the command buffer without calling the execute handler) and N times on fresh buffers.
Mode "on": XLA's defaults; mode "off": --xla_gpu_enable_command_buffer= (no command buffers).

Reports, per mode and phase: the calls of each stage per execution, the launch ids each stage saw,
whether the stream was capturing, and, from the device log, whether every execute kernel of
execution e read e's launch id (written by the initialize stage in stream order)."""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build() -> Path:
  so = HERE / "build" / "probe.so"
  src = HERE / "probe.cu"
  if so.exists() and so.stat().st_mtime > src.stat().st_mtime:
    return so
  import jax.ffi
  so.parent.mkdir(exist_ok=True)
  cmd = ["nvcc", "-std=c++20", "-O2", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC",
         f"-I{jax.ffi.include_dir()}", str(src), "-o", str(so)]
  subprocess.run(cmd, check=True, capture_output=True, text=True)
  return so


class Rec(ctypes.Structure):
  _fields_ = [("stage", ctypes.c_int64), ("capturing", ctypes.c_int64), ("run", ctypes.c_int64), ("site", ctypes.c_int64)]


def one_mode(mode: str, executions: int, calls: int) -> dict:
  if mode == "off":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
  import jax
  import jax.numpy as jnp
  import numpy as np
  lib = ctypes.cdll.LoadLibrary(str(build()))
  jax.ffi.register_ffi_target("probe_stages", {"prepare": jax.ffi.pycapsule(lib.ProbePrepare),
                                               "initialize": jax.ffi.pycapsule(lib.ProbeInitialize),
                                               "execute": jax.ffi.pycapsule(lib.ProbeExecute)}, platform="CUDA")

  def body(x):
    for i in range(calls):
      x = jnp.tanh(x) * 1.0001 + 0.001
      x = jax.ffi.ffi_call("probe_stages", jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True)(
          x, site=np.int64(i))
    return x

  recs_n = ctypes.c_int64
  lib.probe_records.restype = recs_n
  lib.probe_log.restype = ctypes.c_int64

  def records():
    buf = (Rec * 1_000_000)()
    n = lib.probe_records(buf, len(buf))
    return [(r.stage, r.capturing, r.run, r.site) for r in buf[:n]]

  def device_log():
    buf = (ctypes.c_uint64 * (1 << 16))()
    n = lib.probe_log(buf, len(buf))
    return [(int(v) >> 32, int(v) & 0xffffffff) for v in buf[:max(n, 0)]], n

  out = {"mode": mode, "jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "calls_per_execution": calls,
         "executions_per_phase": executions, "phases": {}}
  x0 = jnp.ones((256, 256), jnp.float32)
  for phase, donate in (("fresh", False), ("donated", True)):
    f = jax.jit(body, donate_argnums=(0,) if donate else ())
    r0, (_, l0) = len(records()), device_log()
    x = jnp.array(x0)
    x = f(x)  # compile, record
    x.block_until_ready()
    r1, (_, l1) = len(records()), device_log()
    for _ in range(executions):
      x = f(x) if donate else f(jnp.array(x0))
    x.block_until_ready()
    recs = records()[r1:]
    log, l2 = device_log()
    log = log[l1:l2] if l2 >= 0 else []
    by_stage = {s: [r for r in recs if r[0] == s] for s in (1, 2, 3)}
    runs = {s: sorted({r[2] for r in by_stage[s]}) for s in (1, 2, 3)}
    # The initialize stage's launch ids, in order, one per execution (its first call each time).
    init_runs = []
    for r in by_stage[2]:
      if not init_runs or init_runs[-1] != r[2]:
        init_runs.append(r[2])
    words = [w for _, w in log]
    out["phases"][phase] = {
        "warmup_records": r1 - r0, "warmup_log_entries": l1 - l0,
        "calls_per_execution": {name: len(by_stage[s]) / executions for s, name in ((1, "prepare"), (2, "initialize"),
                                                                                   (3, "execute"))},
        "distinct_launch_ids": {name: len(runs[s]) for s, name in ((1, "prepare"), (2, "initialize"), (3, "execute"))},
        "initialize_capturing": sorted({r[1] for r in by_stage[2]}),
        "execute_capturing": sorted({r[1] for r in by_stage[3]}),
        "device_log_entries": len(log),
        # Every execute kernel read the launch id its execution's initialize stage wrote (in order).
        "kernels_read_own_launch_id": (len(init_runs) == executions and len(words) == executions * calls and
                                       all(words[e * calls + i] == (init_runs[e] & 0xffffffff)
                                           for e in range(executions) for i in range(calls))),
        "first_words": words[:2 * calls], "first_init_runs": [int(v) & 0xffffffff for v in init_runs[:3]],
    }
  # A program whose host callback raises half-way on every other execution (as a failed step
  # would): do the stages still run once per execution for every call, the captured ones after
  # the failure point included, and do the next execution's kernels read their own launch id?
  from jax.experimental import io_callback
  state = {"n": 0}

  def maybe_raise(v):
    state["n"] += 1
    if state["n"] % 2 == 0:
      raise RuntimeError("probe: injected failure")
    return v

  def failing(x):
    for i in range(calls):
      if i == calls // 2:
        x = io_callback(maybe_raise, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=False)
      x = jnp.tanh(x) * 1.0001 + 0.001
      x = jax.ffi.ffi_call("probe_stages", jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True)(
          x, site=np.int64(100 + i))
    return x

  f = jax.jit(failing)
  f(jnp.array(x0)).block_until_ready()  # compile (state n=1: no failure)
  r1, (_, l1) = len(records()), device_log()
  failed = 0
  for _ in range(executions):
    try:
      f(jnp.array(x0)).block_until_ready()
    except Exception:  # noqa: BLE001 - the injected failure
      failed += 1
  recs = records()[r1:]
  log, l2 = device_log()
  log = log[l1:l2] if l2 >= 0 else []
  out["phases"]["failing"] = {
      "failed_executions": failed,
      "calls_per_execution": {name: sum(1 for r in recs if r[0] == s) / executions
                              for s, name in ((1, "prepare"), (2, "initialize"), (3, "execute"))},
      "device_log_entries": len(log),
      "log_sites_words": log[:4 * calls],
      "init_runs": [r[2] & 0xffffffff for r in recs if r[0] == 2][:4 * calls],
  }
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--mode", choices=["on", "off"])
  ap.add_argument("--executions", type=int, default=20)
  ap.add_argument("--calls", type=int, default=8)
  ap.add_argument("--out")
  a = ap.parse_args()
  if a.mode:
    res = one_mode(a.mode, a.executions, a.calls)
    print("RESULT " + json.dumps(res), flush=True)
    return 0
  results = []
  for mode in ("on", "off"):
    p = subprocess.run([sys.executable, __file__, "--mode", mode, "--executions", str(a.executions), "--calls",
                        str(a.calls)], capture_output=True, text=True, timeout=300)
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    results.append(json.loads(line[-1][7:]) if line else {"mode": mode, "error": p.stderr[-2000:]})
    print(json.dumps(results[-1], indent=1), flush=True)
  if a.out:
    Path(a.out).write_text(json.dumps({"benchmark": "ffi_stage_probe", "command": " ".join(sys.argv),
                                       "results": results}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
