"""SPMD cases run both across processes (jax_dfccl, in the workers) and in one
process (jax.lax, in the test): name -> (mesh kind, body(lib), input)."""
from __future__ import annotations

import numpy as np


def _input(n, dtype=np.float32, cols=8, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n * 4, cols)) * 4
  return x.astype(dtype)


def cases(lib, n: int, two_d: bool):
  """lib: jax.lax or jax_dfccl (same signatures).  Each case: (mesh kind
  "1d" (axis x over every device) or "2d" (axes p (processes) x d (devices of
  one process)), in_spec axes, body, global input)."""
  import jax
  import jax.numpy as jnp

  def fori(x):
    def step(i, v):
      kw = {"key": "loop"} if lib is not jax.lax else {}
      return v * 0.5 + lib.psum(v, "x", **kw) * 0.1 + i.astype(v.dtype)
    return jax.lax.fori_loop(0, 5, step, x)

  out = {
      "psum": ("1d", lambda x: lib.psum(x, "x"), _input(n)),
      "pmax": ("1d", lambda x: lib.pmax(x, "x"), _input(n, seed=1)),
      "pmin_i32": ("1d", lambda x: lib.pmin(x, "x"), _input(n, np.int32, seed=2)),
      "psum_bf16": ("1d", lambda x: lib.psum(x, "x"), _input(n, jnp.bfloat16, seed=3)),
      "all_gather": ("1d", lambda x: lib.all_gather(x, "x", tiled=True), _input(n, seed=4)),
      "psum_scatter": ("1d", lambda x: lib.psum_scatter(x, "x", scatter_dimension=1, tiled=True),
                       _input(n, cols=8 * n, seed=5)),
      "all_to_all": ("1d", lambda x: lib.all_to_all(x, "x", 1, 0, tiled=True), _input(n, cols=4 * n, seed=6)),
      "ppermute": ("1d", lambda x: lib.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)]), _input(n, seed=7)),
      "fori_psum": ("1d", fori, _input(n, seed=8)),
  }
  if two_d:
    out.update({
        "psum_d": ("2d", lambda x: lib.psum(x, "d"), _input(n, seed=9)),
        "psum_p": ("2d", lambda x: lib.psum(x, "p"), _input(n, seed=10)),
        "all_gather_pd": ("2d", lambda x: lib.all_gather(x, ("p", "d"), tiled=True), _input(n, seed=11)),
    })
  return out


def run(lib, mesh1, mesh2, n, shard_map, make_input):
  """Runs every case; returns name -> list of per-mesh-position outputs
  (None where this process holds no shard)."""
  import jax
  from jax.sharding import PartitionSpec as P
  res = {}
  for name, (kind, body, x) in cases(lib, n, mesh2 is not None).items():
    mesh = mesh1 if kind == "1d" else mesh2
    spec = P("x") if kind == "1d" else P(("p", "d"))
    f = jax.jit(shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    y = f(make_input(x, mesh, spec))
    pos = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    outs = [None] * n
    for s in y.addressable_shards:
      outs[pos[s.device.id]] = np.asarray(s.data)
    res[name] = outs
  return res
