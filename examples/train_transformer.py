"""A small transformer trained end to end with jax_dfccl collectives and optax.

The model: token embedding, two blocks (``CONFIG``) of causal self-attention and a
mixture-of-experts feed-forward layer (top-1 routing, one expert per device of
the ``model`` axis), a final norm and the unembedding.  It learns a synthetic
sequence rule (each token is the sum of the two before it, modulo the vocabulary).

The devices form a ``data`` x ``model`` mesh (2 x 4 on 8 CPU devices by default):

* **data parallelism**: each ``data`` row of the mesh trains on its own part of
  the batch; the gradients are averaged with ``jax.lax.pmean`` traced inside
  ``jax_dfccl.patch_lax()``, so the existing jax.lax code runs on jax_dfccl's
  collectives;
* **tensor parallelism** (Megatron, sequence-parallel): the attention's QKV
  projection is ``jax_dfccl.all_gather_matmul`` (the gather of the token rows
  hidden behind the GEMM) and its output projection
  ``jax_dfccl.matmul_reduce_scatter``; the heads are split over ``model``.  The
  same model code runs per shard inside the training step's ``shard_map`` and
  on global arrays from plain ``jax.jit`` (the evaluation, :func:`make_eval`),
  where the two ops partition themselves.  (The training step is one
  ``shard_map`` over both axes because the gradient average is explicit jax.lax
  code; the ops' global form does not run inside a ``shard_map`` manual over
  ``data`` only.)
* **mixture of experts**: each token goes to one expert; the tokens travel to
  their expert's device and back with ``jax_dfccl.ragged_all_to_all`` (counts
  exchanged with ``jax_dfccl.all_to_all``), no token dropped.

``--compare`` also trains the same model built from jax.lax collectives
(``all_gather`` + dot, dot + ``psum_scatter``, ``pmean`` unpatched) with a
dense mixture of experts (every device gathers the expert weights and applies
each token's expert itself: XLA:CPU has no ``ragged_all_to_all``) and checks
that the first 20 losses agree (rtol 1e-5); the exit status is 1 if they do
not, or if the loss did not decrease.

    python examples/train_transformer.py --steps 300 --plot loss.png [--compare]
    python examples/train_transformer.py --gpu --steps 300      # on the GPUs JAX sees
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

if __name__ == "__main__" and "--gpu" not in sys.argv:  # 8 CPU devices (set before jax starts)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_dfccl  # noqa: E402

CONFIG = dict(vocab=32, dim=32, heads=4, head_dim=8, seq=16, ffn=64, layers=2, batch=8, lr=1e-2)
ROWS = ("data", "model")
# --compare checks the first COMPARE_STEPS losses (rtol 1e-5).  Later the rounding differences of
# the two implementations (the order of their sums) grow: training amplifies them, and top-1 routing
# is discontinuous (here about step 80 on 8 CPU devices).
COMPARE_STEPS = 20  # the token rows are split over both mesh axes


# ---- data and parameters ----------------------------------------------------------------------
def batch(step: int, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
  """Sequences with t[i] = (t[i-1] + t[i-2]) mod vocab from random first two tokens: (inputs, targets),
  each ``[batch * seq]`` int32 (sequence after sequence)."""
  rng = np.random.default_rng(10_000 + step)
  v, n = cfg["vocab"], cfg["seq"] + 1
  t = np.zeros((cfg["batch"], n), np.int64)
  t[:, :2] = rng.integers(0, v, (cfg["batch"], 2))
  for i in range(2, n):
    t[:, i] = (t[:, i - 1] + t[:, i - 2]) % v
  return t[:, :-1].reshape(-1).astype(np.int32), t[:, 1:].reshape(-1).astype(np.int32)


def init_params(cfg: dict, experts: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  d, hd, f = cfg["dim"], cfg["heads"] * cfg["head_dim"], cfg["ffn"]

  def normal(*shape, fan_in):
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
  p = {"embed": normal(cfg["vocab"], d, fan_in=1) * 0.5, "norm_f": np.ones(d, np.float32),
       "unembed": normal(d, cfg["vocab"], fan_in=d)}
  for l in range(cfg["layers"]):
    # QKV columns are [heads, 3, head_dim]: a column block of whole heads per device.
    p.update({f"{l}/norm1": np.ones(d, np.float32), f"{l}/wqkv": normal(d, 3 * hd, fan_in=d),
              f"{l}/wo": normal(hd, d, fan_in=hd), f"{l}/norm2": np.ones(d, np.float32),
              f"{l}/router": normal(d, experts, fan_in=d), f"{l}/w1": normal(experts, d, f, fan_in=d),
              f"{l}/w2": normal(experts, f, d, fan_in=f)})
  return p


def param_specs(params: dict) -> dict:
  """Heads (QKV columns, output-projection rows) and experts split over ``model``; the rest replicated."""
  def spec(name):
    kind = name.split("/")[-1]
    return {"wqkv": P(None, "model"), "wo": P("model", None), "w1": P("model"), "w2": P("model")}.get(kind, P())
  return {k: spec(k) for k in params}


# ---- the model ---------------------------------------------------------------------------------
def _rmsnorm(x, g):
  return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g


def _tp_in(x, w, lib):
  """Rows split over ``model`` times columns split over ``model``: the gathered rows' product."""
  if lib == "dfccl":
    return jax_dfccl.all_gather_matmul(x, w, "model")
  return lax.all_gather(x, "model", axis=0, tiled=True) @ w


def _tp_out(x, w, lib):
  """Columns split over ``model`` times rows split over ``model``: the sum, its rows scattered."""
  if lib == "dfccl":
    return jax_dfccl.matmul_reduce_scatter(x, w, "model")
  return lax.psum_scatter(x @ w, "model", scatter_dimension=0, tiled=True)


def _attention(h, wqkv, wo, cfg, lib):
  qkv = _tp_in(h, wqkv, lib)  # [every token of the data row, local heads * 3 * head_dim]
  rows, dh, t = qkv.shape[0], cfg["head_dim"], cfg["seq"]
  qkv = qkv.reshape(rows // t, t, -1, 3, dh)
  q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
  s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(dh)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
  o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v).reshape(rows, -1)
  return _tp_out(o, wo, lib)  # back to this device's rows


def _route(x, router):
  probs = jax.nn.softmax(x @ router, axis=-1)
  expert = jnp.argmax(probs, axis=-1).astype(jnp.int32)
  return expert, jnp.take_along_axis(probs, expert[:, None], axis=-1)


def _moe_dispatch(x, router, w1, w2):
  """Per shard: this device's tokens to their experts' devices (``ragged_all_to_all``), through
  the local expert, and back."""
  n, m = lax.axis_size("model"), x.shape[0]
  expert, gate = _route(x, router)
  order = jnp.argsort(expert, stable=True)
  counts = jnp.sum(jax.nn.one_hot(expert, n, dtype=jnp.int32), axis=0)  # tokens for each expert
  offsets = jnp.cumsum(counts) - counts                                  # their rows in the sorted tokens
  a2a = lambda v: jax_dfccl.all_to_all(v, "model", 0, 0, tiled=True)  # noqa: E731
  recv_counts = a2a(counts)                                              # tokens from each device
  recv_offsets = jnp.cumsum(recv_counts) - recv_counts                   # where they land here
  there = a2a(recv_offsets)                                              # where ours land at each expert
  got = jax_dfccl.ragged_all_to_all(x[order], jnp.zeros((n * m, x.shape[1]), x.dtype), offsets, counts,
                                    there, recv_counts, axis_name="model")
  y = jax.nn.gelu(got @ w1[0]) @ w2[0]  # rows past the received ones are zeros and stay zeros
  back = jax_dfccl.ragged_all_to_all(y, jnp.zeros_like(x), recv_offsets, recv_counts, a2a(offsets), counts,
                                     axis_name="model")
  return jnp.zeros_like(x).at[order].set(back) * gate


def _moe_dense(x, router, w1, w2):
  """Per shard, the jax.lax reference: every expert's weights gathered, each token through its own."""
  expert, gate = _route(x, router)
  w1 = lax.all_gather(w1, "model", axis=0, tiled=True)[expert]
  w2 = lax.all_gather(w2, "model", axis=0, tiled=True)[expert]
  h = jax.nn.gelu(jnp.einsum("md,mdf->mf", x, w1))
  return jnp.einsum("mf,mfd->md", h, w2) * gate


def forward(params: dict, tokens, cfg: dict, lib: str, mesh=None):
  """Logits of ``tokens`` (rows).  ``mesh=None``: per shard, inside a ``shard_map`` over ``mesh``
  (this device's rows); else global arrays in plain ``jax.jit`` (the mixture of experts, per shard
  by nature, runs in a ``shard_map`` of its own)."""
  moe = _moe_dispatch if lib == "dfccl" else _moe_dense
  x = params["embed"][tokens]
  for l in range(cfg["layers"]):
    x = x + _attention(_rmsnorm(x, params[f"{l}/norm1"]), params[f"{l}/wqkv"], params[f"{l}/wo"], cfg, lib)
    h = _rmsnorm(x, params[f"{l}/norm2"])
    ws = (params[f"{l}/router"], params[f"{l}/w1"], params[f"{l}/w2"])
    if mesh is not None:
      specs = (P(ROWS), P(), P("model"), P("model"))
      h = jax.shard_map(moe, mesh=mesh, in_specs=specs, out_specs=P(ROWS), check_vma=False)(h, *ws)
    else:
      h = moe(h, *ws)
    x = x + h
  return _rmsnorm(x, params["norm_f"]) @ params["unembed"]


# ---- training --------------------------------------------------------------------------------
def make_train_step(mesh, cfg: dict, opt, specs: dict, state_shardings, lib: str = "dfccl"):
  """The jitted step ``(params, opt_state, inputs, targets) -> (params, opt_state, loss)`` (the loss
  before the update); ``state_shardings``: those of (params, opt_state)."""
  rows_per_replica = cfg["batch"] * cfg["seq"] // mesh.shape["data"]
  sync = jax_dfccl.patch_lax if lib == "dfccl" else contextlib.nullcontext

  def grads(params, inputs, targets):  # per shard
    def local_loss(p):
      ce = optax.softmax_cross_entropy_with_integer_labels(forward(p, inputs, cfg, lib), targets)
      return jnp.sum(ce) / rows_per_replica  # summed over 'model': the data row's mean
    loss, g = jax.value_and_grad(local_loss)(params)
    with sync():  # jax.lax code; inside patch_lax() it traces jax_dfccl's collectives
      # A weight replicated over 'model' got a part of its gradient on each device of the data row.
      g = {k: v if "model" in specs[k] else lax.psum(v, "model") for k, v in g.items()}
      g = lax.pmean(g, "data")  # data parallelism
      loss = lax.pmean(lax.psum(loss, "model"), "data")
    return loss, g

  # check_vma=False: gradients stay per device (the reductions above are the only ones).
  grads = jax.shard_map(grads, mesh=mesh, in_specs=(specs, P(ROWS), P(ROWS)), out_specs=(P(), specs),
                        check_vma=False)

  def step(params, opt_state, inputs, targets):
    loss, g = grads(params, inputs, targets)
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # The results keep the arguments' shardings, so every step runs the program compiled for the first.
  return jax.jit(step, out_shardings=(*state_shardings, NamedSharding(mesh, P())))


def make_eval(mesh, cfg: dict):
  """The mean loss from plain ``jax.jit`` on global arrays: the tensor-parallel ops partition
  themselves over ``model``."""
  @jax.jit
  def evaluate(params, inputs, targets):
    logits = forward(params, inputs, cfg, "dfccl", mesh=mesh)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
  return evaluate


def make_mesh(gpu: bool = False) -> Mesh:
  """8 CPU devices as 2 x 4; on GPUs, ``model`` = 4, 2 or 1 (dividing the GPU count), ``data`` the rest."""
  devs = jax.devices("gpu") if gpu else jax.devices("cpu")[:8]
  model = next(m for m in (4, 2, 1) if len(devs) % m == 0)
  return Mesh(np.array(devs).reshape(len(devs) // model, model), ("data", "model"))


def place(mesh, params: dict, specs: dict):
  return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}


def train(mesh, steps: int, lib: str = "dfccl", cfg: dict = CONFIG, progress=None) -> dict:
  """Trains ``steps`` steps from the same initial parameters and data; the losses, the first and
  the last parameters (numpy) and the seconds per step after the first."""
  params0 = init_params(cfg, experts=mesh.shape["model"])
  specs = param_specs(params0)
  opt = optax.adam(cfg["lr"])
  params = place(mesh, params0, specs)
  replicated = NamedSharding(mesh, P())
  opt_state = jax.tree.map(lambda v: v if isinstance(v.sharding, NamedSharding) else jax.device_put(v, replicated),
                           opt.init(params))
  step = make_train_step(mesh, cfg, opt, specs, jax.tree.map(lambda v: v.sharding, (params, opt_state)), lib)
  rows = NamedSharding(mesh, P(ROWS))
  losses, t0, t1 = [], time.perf_counter(), None
  for i in range(steps):
    inputs, targets = (jax.device_put(a, rows) for a in batch(i, cfg))
    params, opt_state, loss = step(params, opt_state, inputs, targets)
    losses.append(float(loss))
    t1 = t1 or time.perf_counter()
    if progress:
      progress(i + 1, steps, losses[-1], time.perf_counter() - t0)
  per_step = (time.perf_counter() - t1) / max(steps - 1, 1) if t1 else 0.0
  return {"losses": losses, "params0": params0, "params": jax.tree.map(np.asarray, params),
          "seconds_per_step": per_step}


def progress_bar(width: int = 30):
  """A plain-text progress bar on stderr (redrawn in place on a terminal, every 10% otherwise)."""
  tty = sys.stderr.isatty()

  def show(done, total, loss, seconds):
    if not tty and done not in (1, total) and done % max(total // 10, 1):
      return
    filled = width * done // total
    bar = "#" * filled + "." * (width - filled)
    line = f"[{bar}] {done}/{total} loss {loss:.4f} {seconds:.1f} s"
    print(("\r" + line) if tty else line, end="\n" if not tty or done == total else "", file=sys.stderr,
          flush=True)
  return show


def plot(path: str, runs: dict) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for (label, losses), style in zip(runs.items(), ("-", "--")):
    ax.plot(range(1, len(losses) + 1), losses, style, label=label)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy loss")
  ax.set_yscale("log")
  ax.set_title("examples/train_transformer.py")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--gpu", action="store_true", help="train on the GPUs JAX sees instead of 8 CPU devices")
  ap.add_argument("--plot", metavar="FILE", help="save the loss curve (PNG, PDF, SVG) to FILE")
  ap.add_argument("--compare", action="store_true", help="also train the jax.lax version and compare the losses")
  a = ap.parse_args(argv)
  if a.gpu:
    jax.config.update("jax_default_matmul_precision", "highest")
  mesh = make_mesh(a.gpu)
  print(f"mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform.upper()} devices; "
        f"model {CONFIG}", flush=True)
  ours = train(mesh, a.steps, "dfccl", progress=progress_bar())
  cfg = CONFIG
  inputs, targets = (jax.device_put(v, NamedSharding(mesh, P(ROWS))) for v in batch(a.steps, cfg))
  params = place(mesh, ours["params"], param_specs(ours["params"]))
  held_out = float(make_eval(mesh, cfg)(params, inputs, targets))
  print(f"jax_dfccl: loss {ours['losses'][0]:.4f} -> {ours['losses'][-1]:.4f} in {a.steps} steps "
        f"({ours['seconds_per_step'] * 1e3:.1f} ms/step); held-out batch (plain jit): {held_out:.4f}")
  runs, ok = {"jax_dfccl": ours["losses"]}, ours["losses"][-1] < ours["losses"][0]
  if a.compare:
    ref = train(mesh, a.steps, "lax")
    rel = np.abs(np.array(ours["losses"]) - ref["losses"]) / np.abs(ref["losses"])
    first = min(COMPARE_STEPS, a.steps)
    ok &= bool(rel[:first].max() < 1e-5)
    runs["jax.lax (dense MoE)"] = ref["losses"]
    print(f"jax.lax:   loss {ref['losses'][0]:.4f} -> {ref['losses'][-1]:.4f} "
          f"({ref['seconds_per_step'] * 1e3:.1f} ms/step); largest relative difference of the losses: "
          f"{rel[:first].max():.1e} in the first {first} steps (checked: < 1e-5), {rel.max():.1e} in all")
  if a.plot:
    plot(a.plot, runs)
    print(f"loss plot: {a.plot}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
