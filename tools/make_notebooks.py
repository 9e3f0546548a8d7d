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

profiling = [
    md("# Profiling jax_dfccl\n\n1. Bandwidth and latency per collective, jax_dfccl vs jax.lax, "
       "from the benchmark results committed under `benchmarks/results/` "
       "(`benchmarks/collectives.py`).\n2. A timeline of the chaos-order workload from the "
       "runtime's trace: every slice is one collective instance running on a device's daemon; "
       "it ends when the instance finishes or is **preempted** (waiting for peers beyond its "
       "spin budget) so another can run."),
    code("import glob, json, os\n"
         "os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')\n"
         "import matplotlib\nimport matplotlib.pyplot as plt\n"
         "import numpy as np\n"
         "files = sorted(glob.glob('../benchmarks/results/collectives_*.json'))\n"
         "print(files or 'no collectives benchmark results committed yet')"),
    code("def curves(path):\n"
         "    data = json.load(open(path))\n"
         "    run = data.get('final', data)\n"
         "    rows = run.get('rows', [])\n"
         "    ops = sorted({r['op'] for r in rows})\n"
         "    if not ops:\n"
         "        print('no rows in', path); return\n"
         "    series = sorted({k.rsplit('/', 1)[0] for r in rows for k in r if k.endswith('/us')})\n"
         "    fig, axes = plt.subplots(2, len(ops), figsize=(4 * len(ops), 6), squeeze=False)\n"
         "    for j, op in enumerate(ops):\n"
         "        sel = sorted((r for r in rows if r['op'] == op), key=lambda r: r['bytes'])\n"
         "        b = [r['bytes'] for r in sel]\n"
         "        for name in series:\n"
         "            style = '-' if name.startswith('dfccl') else '--'\n"
         "            axes[0, j].loglog(b, [r[name + '/us'] for r in sel], 'o' + style, label=name)\n"
         "            axes[1, j].semilogx(b, [r[name + '/busbw_GBs'] for r in sel], 'o' + style, label=name)\n"
         "        axes[0, j].set_title(op); axes[0, j].set_ylabel('us / op')\n"
         "        axes[1, j].set_ylabel('busbw GB/s'); axes[1, j].set_xlabel('bytes per device')\n"
         "    axes[0, 0].legend(fontsize=7)\n"
         "    hdr = data.get('header', {})\n"
         "    fig.suptitle(f\"{hdr.get('machine', '')}  {hdr.get('date', '')}\")\n"
         "    fig.tight_layout(); plt.show()\n"
         "    for size, c in run.get('chaos', {}).items():\n"
         "        if isinstance(c, dict) and 'ratio' in c:\n"
         "            print(f'chaos order, {size} B per collective: jax_dfccl {c[\"dfccl_chaos_ms\"]:.3f} ms vs '\n"
         "                  f'consistent-order jax.lax {c[\"lax_consistent_ms\"]:.3f} ms (x{c[\"ratio\"]:.2f}), exact: {c[\"matches_lax\"]}')\n"
         "    print('jax.lax chaos program:', run.get('lax_chaos_subprocess'))\n"
         "for f in files:\n"
         "    curves(f)"),
    md("## Chaos-order timeline (recorded live, on this machine's devices)"),
    code("import jax\nfrom jax.sharding import Mesh\nimport jax_dfccl as dc\n"
         "from jax_dfccl import testing as T, trace\n"
         "devs = jax.devices('gpu') if jax.default_backend() == 'gpu' else jax.devices('cpu')[:8]\n"
         "mesh = Mesh(np.array(devs), ('x',))\n"
         "dc.configure(trace=True)\n"
         "xs = T.chaos_inputs(mesh, 'x')\n"
         "prog = T.chaos_program(mesh, 'x', 3)\n"
         "jax.block_until_ready(prog(*xs))          # compile + warm up\n"
         "n0 = len(trace.records())\n"
         "jax.block_until_ready(prog(*xs))\n"
         "recs = trace.records()[n0:]\n"
         "dc.configure(trace=False)\n"
         "print(len(recs), 'events;', dc.stats())"),
    code("events = trace.to_chrome_trace(recs)['traceEvents']   # the same slices as the Perfetto export\n"
         "names = sorted({e['name'].split('#')[0] for e in events if e['ph'] == 'X'})\n"
         "color = {k: plt.cm.tab10(i % 10) for i, k in enumerate(names)}\n"
         "fig, ax = plt.subplots(figsize=(12, 4))\n"
         "for e in events:\n"
         "    if e['ph'] == 'X' and isinstance(e['tid'], int):  # the daemons' tracks (GPU adds XLA-stream tracks)\n"
         "        ax.broken_barh([(e['ts'], max(e['dur'], 0.5))], (e['tid'] - 0.4, 0.8), color=color[e['name'].split('#')[0]])\n"
         "preempts = [e for e in events if e['ph'] == 'i' and e['name'].startswith('preempt')]\n"
         "ax.plot([e['ts'] for e in preempts], [e['tid'] for e in preempts], 'k|', ms=10)\n"
         "ax.set_xlabel('us'); ax.set_ylabel('device'); ax.set_title(f'chaos order: {len(preempts)} preemptions (|)')\n"
         "ax.legend(handles=[matplotlib.patches.Patch(color=color[k], label=k) for k in names],\n"
         "          fontsize=7, ncol=4, loc='upper right')\n"
         "plt.show()\n"
         "print('Perfetto/Chrome trace:', dc.export_trace('chaos_trace.json'), 'events -> chaos_trace.json')"),
]

for name, cells in (("01_quickstart", quickstart), ("02_profiling", profiling)):
  nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {
      "name": "python3", "display_name": "Python 3", "language": "python"}})
  nbf.write(nb, f"notebooks/{name}.ipynb")
