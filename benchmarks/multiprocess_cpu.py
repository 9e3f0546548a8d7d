"""The CPU runtime across processes on one host: latency of a chain of psums
(jax_dfccl over shared memory vs jax.lax over gloo, both across processes, and
both in one process over as many devices), and the dead-peer detection time
over repetitions.

    python benchmarks/multiprocess_cpu.py --processes 2 --devices 2 --dead-reps 20 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time

ITERS, ELEMS = 200, 1024  # 4 KiB of float32 per device


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def env(devices_flag=None):
  e = dict(os.environ, PYTHONUNBUFFERED="1")
  e["XLA_FLAGS"] = " ".join(f for f in e.get("XLA_FLAGS", "").split()
                            if not f.startswith("--xla_force_host_platform_device_count"))
  return e


def launch(args_of, processes, timeout=300):
  port = free_port()
  procs = [subprocess.Popen([sys.executable, __file__, "--worker", *args_of(i, port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env()) for i in range(processes)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  res = []
  for o in outs:
    line = next((l for l in o.splitlines() if l.startswith("RESULT ")), None)
    res.append(json.loads(line[7:]) if line else {"output": o[-2000:]})
  return [p.returncode for p in procs], res


def chain_time(f, x):
  y = f(x)
  y.block_until_ready()
  t0 = time.perf_counter()
  for _ in range(ITERS):
    y = f(y)
  y.block_until_ready()
  return (time.perf_counter() - t0) / ITERS * 1e6


def worker(a):
  import jax
  jax.config.update("jax_num_cpu_devices", a.devices)
  if a.mode == "dead":
    jax.config.update("jax_enable_recoverability", True)
  if a.processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}", num_processes=a.processes,
                               process_id=a.process_id)
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_dfccl as dc
  dc.configure(timeout_s=10.0)
  dc.initialize()
  mesh = Mesh(np.array(jax.devices()), ("x",))
  n = mesh.size
  x = jax.make_array_from_callback((n, ELEMS), NamedSharding(mesh, P("x")),
                                   lambda idx: np.ones((n, ELEMS), np.float32)[idx] / n)
  smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))  # noqa: E731
  out = {}
  if a.mode == "latency":
    out["dfccl_us"] = chain_time(smap(lambda v: dc.pmean(v, "x")), x)
    out["lax_us"] = chain_time(smap(lambda v: jax.lax.pmean(v, "x")), x)
    out["no_collective_us"] = chain_time(smap(lambda v: v * 1.0001), x)
  else:  # dead: the last process dies 0.3 s into 'B'
    g = smap(lambda v: dc.psum(v, "x", key="B"))
    smap(lambda v: dc.psum(v, "x", key="warm"))(x).block_until_ready()
    if a.process_id == a.processes - 1:
      time.sleep(0.3)
      os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
      g(x).block_until_ready()
    except Exception as e:  # noqa: BLE001
      out["seconds"] = time.monotonic() - t0 - 0.3
      out["error"] = str(e).splitlines()[0][:300]
    try:
      jax.effects_barrier()
    except Exception:  # noqa: BLE001
      pass
  print("RESULT " + json.dumps(out), flush=True)
  if a.mode == "dead" and a.processes > 1:
    from jax._src import distributed
    client = distributed.global_state.client
    if a.process_id == 0:
      for p in range(1, a.processes - 1):
        client.blocking_key_value_get(f"bye/{p}", 20_000)
      time.sleep(1.0)
    else:
      client.key_value_set(f"bye/{a.process_id}", "1")
      jax.distributed.shutdown()


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--processes", type=int, default=2)
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--dead-reps", type=int, default=0)
  ap.add_argument("--out", default=None)
  ap.add_argument("--worker", action="store_true")
  ap.add_argument("--mode", default="latency")
  ap.add_argument("--process-id", type=int, default=0)
  ap.add_argument("--port", type=int, default=0)
  a = ap.parse_args()
  if a.worker:
    return worker(a)
  P, D = a.processes, a.devices
  common = lambda mode, procs, devs: (lambda i, port: ["--mode", mode, "--processes", str(procs), "--devices",  # noqa: E731
                                                      str(devs), "--process-id", str(i), "--port", str(port)])
  codes, multi = launch(common("latency", P, D), P)
  assert not any(codes), multi
  codes, single = launch(common("latency", 1, P * D), 1)
  assert not any(codes), single
  rows = {"multi_process": multi[0], "one_process": single[0]}
  dead = []
  for _ in range(a.dead_reps):
    codes, res = launch(common("dead", P + 1, 1), P + 1)
    dead.append({"codes": codes, "survivors": [r.get("seconds") for r in res[:-1]],
                 "error": res[0].get("error", res[0].get("output", ""))[:200]})
  report = {"date": datetime.date.today().isoformat(), "machine": f"{platform.node()} ({os.cpu_count()} cores)",
            "command": " ".join(sys.argv), "processes": P, "devices_per_process": D, "iters": ITERS,
            "bytes_per_device": ELEMS * 4, "latency": rows, "dead": dead}
  print(json.dumps(report, indent=1))
  if a.out:
    tag = f"multiprocess_cpu_{report['date']}_p{P}d{D}"
    with open(os.path.join(a.out, tag + ".json"), "w") as f:
      json.dump(report, f, indent=1)
    ok = [d for d in dead if d["codes"][:-1] == [0] * P and all(s is not None and s < 1.0 for s in d["survivors"])]
    worst = max((s for d in dead for s in d["survivors"] if s is not None), default=float("nan"))
    with open(os.path.join(a.out, tag + ".md"), "w") as f:
      f.write(f"# CPU runtime across processes ({report['date']}, {report['machine']})\n\n`{report['command']}`\n\n")
      f.write(f"Chain of {ITERS} dependent pmeans of {ELEMS * 4} bytes per device, {P} processes x {D} CPU devices "
              f"(jax.lax over gloo) vs one process with {P * D} devices, µs per op (mean over the chain):\n\n")
      f.write("| where | jax_dfccl | jax.lax | no collective |\n|---|---|---|---|\n")
      for k, r in rows.items():
        f.write(f"| {k} | {r['dfccl_us']:.0f} | {r['lax_us']:.0f} | {r['no_collective_us']:.0f} |\n")
      if dead:
        f.write(f"\nDead peer ({P + 1} processes x 1 device, the last killed with SIGKILL 0.3 s into collective "
                f"'B', timeout_s = 10): error in every survivor and clean exit in {len(ok)} of {len(dead)} "
                f"repetitions; worst detection time after the kill {worst * 1000:.0f} ms.\n\n"
                f"First error: `{dead[0]['error']}`\n")


if __name__ == "__main__":
  main()
