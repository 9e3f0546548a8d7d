"""Writes notebooks/01_quickstart.ipynb (source of truth for its cells)."""
import nbformat as nbf

md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell

quickstart = [
    md("# jax_dfccl quickstart\n\nOrder-free collectives as a drop-in for `jax.lax` collectives "
       "inside `jax.shard_map`. This notebook runs on 8 CPU devices (or your GPUs)."),
    code("import os\n"
         "os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')\n"
         "import jax, jax.numpy as jnp, numpy as np\n"
         "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
         "import jax_dfccl as dc\n"
         "devs = jax.devices('gpu') if jax.default_backend() == 'gpu' else jax.devices('cpu')[:8]\n"
         "mesh = Mesh(np.array(devs), ('x',))\n"
         "print(mesh)"),
    md("## Swap `jax.lax` for `jax_dfccl`\n\nThe same shard_map program, once with each library."),
    code("def layer(lib):\n"
         "    def f(x, w):\n"
         "        h = lib.all_gather(x, 'x', tiled=True) @ w          # gather activations\n"
         "        return lib.psum(jnp.tanh(h).sum(0), 'x')           # reduce a statistic\n"
         "    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P('x'), P(None, 'x')),\n"
         "                                 out_specs=P('x')))\n"
         "n = mesh.size\n"
         "x = jax.device_put(jax.random.normal(jax.random.key(0), (4 * n, 16)), NamedSharding(mesh, P('x')))\n"
         "w = jax.device_put(jax.random.normal(jax.random.key(1), (16, 8 * n)), NamedSharding(mesh, P(None, 'x')))\n"
         "ours, ref = layer(dc)(x, w), layer(jax.lax)(x, w)\n"
         "print('max |difference| vs jax.lax:', float(jnp.max(jnp.abs(ours - ref))))"),
    md("## Start / done, in any order on any rank\n\n"
       "Rank-dependent code (`lax.switch` on the axis index) starts two collectives in opposite "
       "orders. Collectives are matched by `key`, not by issue order."),
    code("def step(x, y):\n"
         "    def rank_even(x, y):\n"
         "        ha = dc.psum_start(x, 'x', key='a'); hb = dc.all_gather_start(y, 'x', key='b')\n"
         "        return dc.done(ha), dc.done(hb)\n"
         "    def rank_odd(x, y):\n"
         "        hb = dc.all_gather_start(y, 'x', key='b'); ha = dc.psum_start(x, 'x', key='a')\n"
         "        return dc.done(ha), dc.done(hb)\n"
         "    return jax.lax.switch(jax.lax.axis_index('x') % 2, [rank_even, rank_odd], x, y)\n"
         "f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P('x'), P('x')), out_specs=(P('x'), P('x')),\n"
         "                          check_vma=False))\n"
         "xs = jax.device_put(jnp.arange(float(n)), NamedSharding(mesh, P('x')))\n"
         "a, b = f(xs, xs * 10)\n"
         "print('psum on every rank:', a, '\\nall_gather on every rank:', b.reshape(n, n)[0])"),
    md("## The chaos-order workload\n\n8 collectives, each rank starting them in its own order and "
       "waiting in another, 100 iterations; compared with jax.lax in one consistent order."),
    code("from jax_dfccl import testing as T\n"
         "xs = T.chaos_inputs(mesh, 'x')\n"
         "ours = T.chaos_program(mesh, 'x', 100)(*xs)\n"
         "ref = T.reference_program(mesh, 'x', 100)(*xs)\n"
         "print('exact:', all(np.array_equal(a, b) for a, b in zip(ours, ref)))\n"
         "print(dc.stats())"),
]

nb = nbf.v4.new_notebook(cells=quickstart, metadata={"kernelspec": {
    "name": "python3", "display_name": "Python 3", "language": "python"}})
nbf.write(nb, "notebooks/01_quickstart.ipynb")
