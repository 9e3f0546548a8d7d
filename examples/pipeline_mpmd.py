"""A pipeline-parallel MLP trained across processes: one stage per process,
each process running its own program (MPMD), stages talking through
``jax_dfccl.send`` / ``recv`` start forms.

Schedule: 1F1B with M microbatches.  Every stage starts all the receives it
will need at the beginning of a step, in a stage-specific order (even stages
in microbatch order, odd stages in reverse), and its sends as soon as their
data exists; matching is by key (``act{m}`` / ``grad{m}``) and sequence (the
step), never by issue order, so no order can deadlock or pair the wrong
transfers.  What a stage waits for, and when, is its own schedule: XLA orders
independent custom calls as it likes (it would hoist the wait for every
activation above the first gradient send, a true cycle with the previous
stage), so each wait is tied after the stage's previous step with an
optimization barrier (``after``).

    python examples/pipeline_mpmd.py --processes 4 --steps 20

launches the processes (loopback coordinator, one CPU device each), trains,
then trains the same model in this process without any pipeline and compares
the losses (rtol 1e-5).  ``--json`` prints the result as one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

WIDTH, BATCH, MICRO, LR = 16, 8, 4, 0.05


# ---- the model (shared by the pipeline and the reference) -------------------------
def init_params(stage: int):
  import numpy as np
  rng = np.random.default_rng(1000 + stage)
  w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
  b = (0.1 * rng.standard_normal((WIDTH,))).astype(np.float32)
  return w, b


def data(step: int):
  import numpy as np
  rng = np.random.default_rng(step)
  x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
  y = np.sin(x[:, ::-1]).astype(np.float32)
  return x, y


def stage_fn(params, a, last: bool):
  import jax.numpy as jnp
  w, b = params
  z = a @ w + b
  return z if last else jnp.tanh(z)


def loss_fn(pred, y):
  import jax.numpy as jnp
  return jnp.mean((pred - y) ** 2)


def reference(processes: int, steps: int) -> list[float]:
  """The same model and updates in one process: per microbatch, forward through
  every stage and backward, gradients summed in microbatch order."""
  import jax
  import jax.numpy as jnp
  params = [tuple(map(jnp.asarray, init_params(s))) for s in range(processes)]

  def mb_loss(params, x, y):
    a = x
    for s, p in enumerate(params):
      a = stage_fn(p, a, s == processes - 1)
    return loss_fn(a, y)

  @jax.jit
  def step(params, x, y):
    mb = BATCH // MICRO
    total, grads = 0.0, None
    for m in range(MICRO):
      l, g = jax.value_and_grad(mb_loss)(params, x[m * mb:(m + 1) * mb], y[m * mb:(m + 1) * mb])
      total = total + l
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    params = jax.tree.map(lambda p, g: p - LR * g / MICRO, params, grads)
    return params, total / MICRO

  losses = []
  for t in range(steps):
    x, y = data(t)
    params, l = step(params, x, y)
    losses.append(float(l))
  return losses


# ---- one stage (one process) ----------------------------------------------------
def schedule(stage: int, processes: int) -> list[tuple[str, int]]:
  """1F1B: warm-up forwards, then one forward one backward, then the rest of the backwards."""
  warm = min(processes - stage - 1, MICRO)
  ops = [("F", m) for m in range(warm)]
  for i in range(MICRO - warm):
    ops += [("F", warm + i), ("B", i)]
  ops += [("B", m) for m in range(MICRO - warm, MICRO)]
  return ops


def make_step(s: int, processes: int, mesh, prev, nxt):
  """Stage s's jitted training step (params, x, y) -> (params, mean loss); prev /
  nxt: the devices of the neighbouring stages."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  import jax_dfccl as dfccl
  last, first = s == processes - 1, s == 0
  mb = BATCH // MICRO
  zeros = jnp.zeros((mb, WIDTH), jnp.float32)
  def train_step(params, x, y):
    order = list(range(MICRO)) if s % 2 == 0 else list(reversed(range(MICRO)))
    acts_in = {m: dfccl.recv_start(zeros, prev, key=f"act{m}") for m in order} if not first else {}
    grads_in = {m: dfccl.recv_start(zeros, nxt, key=f"grad{m}") for m in order} if not last else {}
    sends, vjps, total, gsum = [], {}, 0.0, None
    prev_step = params  # the latest result in schedule order

    # XLA orders operations by data dependence only, and on a GPU a done waits on
    # the stream: each step's first operation depends on the previous step's last
    # result, so the stream runs the schedule in this stage's 1F1B order (a done
    # hoisted above a send the peer waits for would be a real cycle).
    def after(value):  # `value`, once the previous step of the schedule ran
      return jax.lax.optimization_barrier((value, prev_step))[0]

    for kind, m in schedule(s, processes):
      if kind == "F":
        a = after(x[m * mb:(m + 1) * mb]) if first else dfccl.done(after(acts_in[m]))
        if last:
          def f(p, a, m=m):
            return loss_fn(stage_fn(p, a, True), y[m * mb:(m + 1) * mb])
          l, vjps[m] = jax.vjp(f, params, a)
          total = total + l
          prev_step = l
        else:
          out, vjps[m] = jax.vjp(lambda p, a: stage_fn(p, a, False), params, a)
          sends.append(dfccl.send_start(out, nxt, key=f"act{m}"))
          prev_step = sends[-1]
      else:
        ct = after(jnp.ones((), jnp.float32)) if last else dfccl.done(after(grads_in[m]))
        g_p, g_a = vjps.pop(m)(ct)
        gsum = g_p if gsum is None else jax.tree.map(jnp.add, gsum, g_p)
        prev_step = gsum
        if not first:
          sends.append(dfccl.send_start(g_a, prev, key=f"grad{m}"))
          prev_step = sends[-1]
    for h in sends:
      dfccl.done(h)
    params = jax.tree.map(lambda p, g: p - LR * g / MICRO, params, gsum)
    return params, total / MICRO

  step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()),
                               check_vma=False))
  return step


def run_stage(process: int, processes: int, port: int, steps: int, timeout_s: float = 60.0, gpu: bool = False,
              config: str = "") -> None:
  import jax
  if gpu:  # one GPU per process (several processes may share one under CUDA MPS)
    jax.config.update("jax_default_matmul_precision", "highest")
  else:
    jax.config.update("jax_num_cpu_devices", 1)
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                             process_id=process)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P
  import jax_dfccl as dfccl
  dfccl.configure(timeout_s=timeout_s)
  for kv in filter(None, config.split(",")):  # e.g. processes_per_host=2,cross_host_transport=nvshmem
    k, v = kv.split("=", 1)
    dfccl.configure(**{k: int(v) if v.isdigit() else v})
  dfccl.initialize()

  dev = {d.process_index: d for d in jax.devices()}
  mesh = Mesh(np.array(jax.local_devices()), ("stage",))
  step = make_step(process, processes, mesh, dev.get(process - 1), dev.get(process + 1))
  s, last = process, process == processes - 1
  params = tuple(map(jnp.asarray, init_params(s)))
  losses = []
  t0 = time.perf_counter()
  try:
    for t in range(steps):
      x, y = data(t)
      params, l = step(params, x, y)
      losses.append(float(l))
  except Exception:
    print(f"stage {process}: in flight when it failed: {dfccl.pending()}", file=sys.stderr, flush=True)
    raise
  dt = time.perf_counter() - t0
  if last:
    print("LOSSES " + json.dumps({"losses": losses, "seconds": dt}), flush=True)


# ---- launcher ---------------------------------------------------------------------
def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def launch(processes: int, steps: int, timeout_s: float = 240.0, gpu: bool = False, stage_timeout_s: float = 60.0,
           config: str = "") -> dict:
  port = free_port()
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if gpu:
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(round(0.5 / processes, 3)))
    # Each process compiles its own stage: XLA's autotuning shared across processes
    # (matched by module fingerprint) would wait for modules the others never compile.
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false"
  else:
    env["JAX_PLATFORMS"] = "cpu"
  procs = [subprocess.Popen([sys.executable, __file__, "--process-id", str(i), "--processes", str(processes),
                             "--port", str(port), "--steps", str(steps), "--timeout-s", str(stage_timeout_s)]
                            + (["--gpu"] if gpu else []) + (["--config", config] if config else []),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
           for i in range(processes)]
  outs, late = [], False
  try:
    deadline = time.monotonic() + timeout_s
    for p in procs:
      try:
        out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:  # what it printed so far, then it is killed
        late = True
        p.kill()
        out, _ = p.communicate()
      outs.append(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  codes = [p.returncode for p in procs]
  if late or any(codes):
    why = f"did not finish within {timeout_s:.0f} s" if late else f"exited with {codes}"
    raise RuntimeError(f"pipeline processes {why}:\n" + "\n".join(f"--- process {i}:\n{o[-3000:]}"
                                                                   for i, o in enumerate(outs)))
  line = next(l for l in outs[-1].splitlines() if l.startswith("LOSSES "))
  return json.loads(line[len("LOSSES "):])


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--processes", type=int, default=2)
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--gpu", action="store_true", help="one GPU per stage (start CUDA MPS first to share one GPU)")
  ap.add_argument("--timeout-s", type=float, default=60.0, help="jax_dfccl.config.timeout_s of the stages")
  ap.add_argument("--deadline-s", type=float, default=240.0, help="wall-clock limit of the whole run")
  ap.add_argument("--config", default="", help="jax_dfccl.configure entries of the stages, k=v,... (e.g. "
                  "processes_per_host=2,cross_host_transport=nvshmem: every 2 stages a host, NVSHMEM between them)")
  a = ap.parse_args()
  if a.process_id is not None:
    return run_stage(a.process_id, a.processes, a.port, a.steps, a.timeout_s, a.gpu, a.config)
  got = launch(a.processes, a.steps, a.deadline_s, gpu=a.gpu, stage_timeout_s=a.timeout_s, config=a.config)
  import numpy as np
  if a.gpu:
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
  ref = reference(a.processes, a.steps)
  ok = bool(np.allclose(got["losses"], ref, rtol=1e-5, atol=0))
  err = float(np.max(np.abs(np.array(got["losses"]) - ref) / np.abs(ref)))
  res = {"processes": a.processes, "steps": a.steps, "match": ok, "max_rel_err": err,
         "pipeline_losses": got["losses"], "reference_losses": ref, "train_seconds": got["seconds"]}
  if a.json:
    print(json.dumps(res))
  else:
    print(f"{a.processes} stages, {a.steps} steps: losses {'match' if ok else 'DIFFER'} "
          f"(max relative error {err:.2e}); first {ref[0]:.6f}, last {ref[-1]:.6f}; "
          f"pipeline training {got['seconds']:.2f} s")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
