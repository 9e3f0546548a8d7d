"""What XLA's FFI stages cost per call on the host, and whether a state made by the instantiate
stage (FFI ``State``) takes the attributes' decoding out of the stages XLA calls every execution
(docs/design/execution_identity.md, "Cost").  Run where a GPU is:

    python3 tools/ffi_stage_probe/costs.py --out costs.json [--calls 100] [--rounds 5]

Builds tools/ffi_stage_probe/costs.cu (into tools/ffi_stage_probe/build/), registers its four
targets — ``cost_plain`` (execute only), ``cost_stages`` (prepare decoding the attributes,
initialize with none: the runtime's dfccl_start_x today), ``cost_state`` (instantiate decoding them
once, prepare and initialize taking the state), ``cost_both`` (prepare and initialize both
decoding), ``cost_init`` (initialize alone, decoding them), ``cost_init_state`` (instantiate,
then initialize alone taking the state) — each with the attributes of a jax_dfccl start, and times one jitted program of
``--calls`` calls of each, between element-wise ops: µs per call for (a) one blocking execution on
fresh buffers (XLA calls every stage of every call, and updates its command buffers), (b) eight
executions enqueued, each donating its input (XLA replays its command buffers: prepare and
initialize only), against ``cost_plain``.  Also the calls of each stage per execution, and whether
the state target ran at all (jax's type registration of this jaxlib)."""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build() -> Path:
  so = HERE / "build" / "costs.so"
  src = HERE / "costs.cu"
  if so.exists() and so.stat().st_mtime > src.stat().st_mtime:
    return so
  import jax.ffi
  so.parent.mkdir(exist_ok=True)
  subprocess.run(["nvcc", "-std=c++20", "-O2", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC",
                  f"-I{jax.ffi.include_dir()}", str(src), "-o", str(so)], check=True, capture_output=True, text=True)
  return so


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--calls", type=int, default=100)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--out")
  a = ap.parse_args()
  import jax
  import jax.numpy as jnp
  import numpy as np
  lib = ctypes.cdll.LoadLibrary(str(build()))
  cap = lambda name: jax.ffi.pycapsule(getattr(lib, name))  # noqa: E731
  out = {"benchmark": "ffi_stage_costs", "jax": jax.__version__, "device": jax.devices()[0].device_kind,
         "calls_per_execution": a.calls, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
         "targets": {}, "errors": {}}
  lib.cost_state_type_id.restype = ctypes.c_void_p
  lib.cost_state_type_info.restype = ctypes.c_void_p
  lib.cost_calls.restype = ctypes.c_int64
  state_ok = True
  try:  # the state's type (its id is filled in by XLA)
    jax.ffi.register_ffi_type("cost_site_state", {"type_id": jax.ffi.pycapsule(lib.cost_state_type_id()),
                                                  "type_info": jax.ffi.pycapsule(lib.cost_state_type_info())},
                              platform="CUDA")
  except Exception as e:  # noqa: BLE001
    state_ok = False
    out["errors"]["register_ffi_type"] = repr(e)[:500]
  regs = {
      "cost_plain": {"execute": cap("CostPlainExecute")},
      "cost_stages": {"prepare": cap("CostStagesPrepare"), "initialize": cap("CostStagesInitialize"),
                      "execute": cap("CostStagesExecute")},
      "cost_both": {"prepare": cap("CostBothPrepare"), "initialize": cap("CostBothInitialize"),
                    "execute": cap("CostBothExecute")},
  }
  if state_ok:
    regs["cost_state"] = {"instantiate": cap("CostStateInstantiate"), "prepare": cap("CostStatePrepare"),
                          "initialize": cap("CostStateInitialize"), "execute": cap("CostStateExecute")}
    regs["cost_init_state"] = {"instantiate": cap("CostInitStateInstantiate"),
                               "initialize": cap("CostInitStateInitialize"), "execute": cap("CostInitStateExecute")}
  regs["cost_init"] = {"initialize": cap("CostInitInitialize"), "execute": cap("CostInitExecute")}
  for name, stages in regs.items():
    jax.ffi.register_ffi_target(name, stages, platform="CUDA")
  index = {"cost_plain": 0, "cost_stages": 1, "cost_state": 2, "cost_both": 3, "cost_init": 4, "cost_init_state": 5}
  attrs = dict(kind=np.int32(0), reduce_op=np.int32(0), key="cost/probe", key_hash=np.int64(0x5eed),
               group_size=np.int32(2), groups=np.array([0, 1], np.int32), device_ids=np.array([0, 1], np.int64),
               perm=np.array([-1, -1], np.int32))

  def program(name):
    def body(x):
      for i in range(a.calls):
        x = jnp.tanh(x) * 1.0001 + 0.001
        x = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True)(
            x, site=np.int64(i), **attrs)
      return x
    return body

  x0 = jnp.ones((1024,), jnp.float32)
  for name in regs:
    t = index[name]
    row = {}
    try:
      fresh, donated = jax.jit(program(name)), jax.jit(program(name), donate_argnums=0)
      fresh(jnp.array(x0)).block_until_ready()
      c0 = [lib.cost_calls(t, s) for s in range(4)]
      ts = []
      for _ in range(a.rounds):  # (a) one blocking execution on fresh buffers
        x = jnp.array(x0) + 0.0
        x.block_until_ready()
        t0 = time.perf_counter()
        fresh(x).block_until_ready()
        ts.append((time.perf_counter() - t0) / a.calls * 1e6)
      row["fresh_us_per_call"] = sorted(ts)[len(ts) // 2]
      y = donated(jnp.array(x0))
      y.block_until_ready()
      ts = []
      for _ in range(a.rounds):  # (b) eight enqueued, donated
        t0 = time.perf_counter()
        for _ in range(8):
          y = donated(y)
        y.block_until_ready()
        ts.append((time.perf_counter() - t0) / (8 * a.calls) * 1e6)
      row["donated_us_per_call"] = sorted(ts)[len(ts) // 2]
      execs = a.rounds * 9 + 1
      row["stage_calls_per_execution"] = {s: (lib.cost_calls(t, i) - c0[i]) / execs
                                          for i, s in enumerate(("instantiate", "prepare", "initialize", "execute"))}
    except Exception as e:  # noqa: BLE001
      out["errors"][name] = repr(e)[:800]
    out["targets"][name] = row
    print(name, json.dumps(row), flush=True)
  plain = out["targets"].get("cost_plain", {})
  for name, row in out["targets"].items():
    for k in ("fresh_us_per_call", "donated_us_per_call"):
      if k in row and k in plain:
        row[k.replace("_us_per_call", "_extra_us_per_call")] = round(row[k] - plain[k], 3)
  print(json.dumps(out, indent=1))
  if a.out:
    Path(a.out).write_text(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
