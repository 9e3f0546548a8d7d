"""Writes the notebooks (source of truth for their cells).

  python tools/make_notebooks.py                 # all of them
  python tools/make_notebooks.py 03_overlap      # only these (outputs are not kept: execute afterwards)
"""
import sys

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
    md("## Existing `jax.lax` code, unchanged\n\n"
       "`patch_lax()` rebinds the collectives of the `jax.lax` module while the block is open, so "
       "a model written against `jax.lax` is traced on jax_dfccl without edits."),
    code("with dc.patch_lax():\n"
         "    g = layer(jax.lax)              # the jax.lax version of the layer above\n"
         "    hlo = g.lower(x, w).as_text()\n"
         "    patched = g(x, w)\n"
         "print('jax_dfccl custom calls in the program:', hlo.count('custom_call @dfccl_'))\n"
         "print('max |difference| vs jax.lax:', float(jnp.max(jnp.abs(patched - ref))))"),
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
    md("Reading the plots: `collectives_<date>_h200x2.json` and `..._allsizes.json` were measured with "
       "every collective on the daemon; `..._copy_engine.json`, `..._ce_default_check.json`, "
       "`..._allsizes_ce_default.json` and `..._one_call.json` with the copy-engine path from 4 MiB "
       "(`config.copy_engine_min_bytes`, the default since) pulling; `..._one_call.json` also has the "
       "blocking form as one custom call (the current small-message path). `..._ce_push.json` / "
       "`..._ce_pull.json` compare the copy engines pushing (the default now) and pulling at 16 MiB–1 GiB, "
       "`..._ce_push_blocks*.json` the combine kernel's block count, and `..._ce_push_rs_two_streams.json` "
       "a reduce-scatter variant that was slower and is not kept. The copy-engine file's unrolled 1 GiB "
       "all_gather point (516 GB/s) exceeds the link and is not a valid measurement: the copy engines need "
       "3.1–3.2 ms of GPU time per 1 GiB all_gather or psum when pulling "
       "(`benchmarks/results/ce_large_2026-11-30_h200x2.md`). all_gather in long unrolled chains varies a "
       "lot for both implementations; compare the fori_loop curves."),
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

overlap = [
    md("# 03 — GEMM + communication overlap\n\n"
       "`jax_dfccl` provides `all_gather_matmul`, `matmul_reduce_scatter` and `matmul_psum`\n"
       "(see `jax_dfccl/_src/overlap.py`): per shard inside `jax.shard_map`, or on global\n"
       "`NamedSharding`-ed arrays from plain `jax.jit` (custom_partitioning + Shardy rule).\n"
       "On sm90 GPUs (bf16/f16) they run as fused kernels with tile-wise signaling\n"
       "(`xla_ffi/overlap/`); elsewhere as the tail-free ring of XLA dots and collectives.\n\n"
       "This notebook (1) checks the ops against jax.lax on 4 CPU devices, (2) plots the committed\n"
       "GPU benchmark (`benchmarks/results/overlap_*.json`, written by `benchmarks/overlap.py`) and\n"
       "(3) the per-tile timeline of the fused kernels (`benchmarks/results/overlap_timeline_*.json`,\n"
       "written by `benchmarks/overlap_diag.py --timeline`) and (4) the fused GEMM alone on one GPU against\n"
       "XLA's dot (`benchmarks/results/overlap_gemm_*.json`, written by `benchmarks/overlap_gemm.py`)."),
    code("""import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
import glob, json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_dfccl as ov
RESULTS = os.path.join("..", "benchmarks", "results")
print(jax.__version__, jax.devices())"""),
    md("## 1. The ops on CPU, against jax.lax"),
    code("""n = min(4, len(jax.devices()))
mesh = jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n])
put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((8 * n, 96)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((96, 40 * n)) / 10, jnp.bfloat16)
ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)

# per shard, inside shard_map
ag = jax.jit(jax.shard_map(lambda x, w: ov.all_gather_matmul(x, w, "tp"), mesh=mesh,
                           in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
out = ag(put(x, P("tp", None)), put(w, P(None, "tp")))
print("all_gather_matmul (shard_map) max rel err:", float(np.abs(np.asarray(out, np.float32) - ref).max() / np.abs(ref).max()))

# global arrays, plain jit: the op partitions itself
y = jax.jit(lambda x, w: ov.matmul_reduce_scatter(x, w, "tp"))(put(x, P(None, "tp")), put(w, P("tp", None)))
print("matmul_reduce_scatter (plain jit) sharding:", y.sharding.spec,
      "max rel err:", float(np.abs(np.asarray(y, np.float32) - ref).max() / np.abs(ref).max()))"""),
    md("## 2. The GPU benchmark (TP=2, bf16)\n\nThe most recent run by its header date; bars per shape, "
       "then the two targets per shape: ours / max(t_gemm, t_comm) (≤ 1.05) and the better XLA "
       "variant / ours (≥ 1.15 on the LLaMA shapes at M ≤ 4096)."),
    code("""def _date(p):
    try:
        return json.load(open(p)).get("header", {}).get("date", "")
    except (OSError, ValueError):
        return ""
paths = [p for p in glob.glob(os.path.join(RESULTS, "overlap_*.json"))
         if not any(w in os.path.basename(p) for w in ("timeline", "cpu", "overlap_gemm"))]
paths = sorted(paths, key=lambda p: (_date(p), p))
if not paths:
    print("No benchmark results yet: run `python benchmarks/overlap.py --tag h200x2` on a GPU machine.")
    data = None
else:
    data = json.load(open(paths[-1]))
    print(paths[-1]); print(json.dumps({k: data["header"].get(k) for k in ("date", "machine", "command")}, indent=1))"""),
    code("""VARS = ["t_gemm", "t_comm", "sequential", "xla_plain", "xla_windowed", "ours_lax", "ours_dfccl",
        "ours_fused", "bound"]
num = lambda v: isinstance(v, (int, float))
if data:
    import matplotlib.pyplot as plt
    rows = data["rows"]
    nr = (len(rows) + 2) // 3
    fig, axes = plt.subplots(nr, 3, figsize=(15, 2.8 * nr), squeeze=False)
    for ax in axes.flat[len(rows):]:
        ax.axis("off")
    for ax, r in zip(axes.flat, rows):
        names = [v for v in VARS if num(r.get(v))]
        ax.bar(names, [r[v] for v in names],
               color=["#999" if v in ("t_gemm", "t_comm", "bound") else "#4c72b0" if "xla" in v or v == "sequential" else "#dd8452" for v in names])
        ax.set_title(f"{r['kind'].upper()} {r['M']}x{r['N']}x{r['K']}", fontsize=9)
        ax.set_ylabel("ms"); ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout(); plt.show()"""),
    code("""if data:
    print(f"{'shape':24s} {'ours ms':>8s} {'ours/max':>9s} {'ours/bound':>10s} {'XLA/ours':>9s}")
    for r in data["rows"]:
        ours = next((r[v] for v in ("ours_fused", "ours_dfccl", "ours_lax") if num(r.get(v))), None)
        xla = min([r[v] for v in ("xla_plain", "xla_windowed") if num(r.get(v))] or [None], key=lambda v: v or 1e9)
        mx = max([r[v] for v in ("t_gemm", "t_comm") if num(r.get(v))] or [0])
        bound = r.get("bound") if num(r.get("bound")) else None
        f = lambda a, b: f"{a / b:.2f}" if a and b else "-"
        print(f"{r['kind'].upper() + ' ' + str(r['M']) + 'x' + str(r['N']) + 'x' + str(r['K']):24s} "
              f"{ours if ours else float('nan'):8.3f} {f(ours, mx):>9s} {f(ours, bound):>10s} {f(xla, ours):>9s}")"""),
    md("## 3. Per-tile timeline of the fused kernels\n\n"
       "From `benchmarks/overlap_diag.py --timeline` (run by `tools/overlap_gpu.sh`): one profiled "
       "program of a few chained ops per variant, every launch on both GPUs, on the GPUs' global "
       "timer (both follow the host clock).  Per rank one row per SM: a tile's MMA (orange: the "
       "rank's own row block, blue: the peers' blocks), then its wait for the peer (red: RS "
       "partials / ready) and its epilogue (grey: stores, for RS peer tiles over NVLink); AG: "
       "purple, the producer waiting for a tile's rows to arrive (the MMA bar includes it); above the "
       "SMs the copy-engine transfers (red: waiting for the peer's ready, green: the copy); "
       "dotted lines: kernel starts; triangles: the host handler's enqueue time (when the host "
       "clock and the GPU timer agree).  Variants: `fused` (default), `mailbox` (readiness through "
       "host memory only, the first version's handshake), `nocomm` (the same kernel without any "
       "communication: its GEMM alone)."),
    code("""tl_paths = sorted(glob.glob(os.path.join(RESULTS, "overlap_timeline_*.json")))
tl = None
if not tl_paths:
    print("No per-tile timeline committed yet (benchmarks/results/overlap_timeline_<date>_h200x2.json); "
          "it is written on a machine with 2 sm90 GPUs by tools/overlap_gpu.sh "
          "(python benchmarks/overlap_diag.py --timeline FILE).")
else:
    tl = json.load(open(tl_paths[-1]))
    print(tl_paths[-1]); print({k: tl["header"].get(k) for k in ("date", "machine")})
    for run in tl["runs"]:
        print(f"{' '.join(map(str, run['shape'])):24s} {run['variant']:8s} {run['wall_ms_per_op']:.3f} ms/op, "
              f"{len(run['timelines'])} launches")"""),
    code("""def launch_stats(run):
    \"\"\"Per rank: median launch span, gap between launches, mean wait per tile, copies (us).\"\"\"
    out = {}
    for rank in sorted({l["rank"] for l in run["timelines"]}):
        ls = sorted((l for l in run["timelines"] if l["rank"] == rank), key=lambda l: l["base_ns"])
        spans, gaps, waits, copies = [], [], [], []
        for i, l in enumerate(ls):
            t = np.array([row[2:6] for row in l["tile"]], float)
            if not len(t):
                continue
            spans.append((t[:, 3].max() - max(t[:, 0].min(), 0)) / 1e3)
            waits.append(np.mean(np.clip(t[:, 2] - t[:, 1], 0, None)) / 1e3)
            if i:
                prev = ls[i - 1]
                prev_end = prev["base_ns"] + max(row[5] for row in prev["tile"])
                gaps.append((l["base_ns"] - prev_end) / 1e3)
            copies += [(c - b) / 1e3 for _, a, b, c in l["side_rec"] if b >= 0 and c >= 0]
        out[rank] = dict(span=np.median(spans) if spans else None, gap=np.median(gaps) if gaps else None,
                         wait=np.median(waits) if waits else None, copy=np.median(copies) if copies else None)
    return out

if tl:
    for run in tl["runs"]:
        for rank, s in launch_stats(run).items():
            fmt = lambda v: "-" if v is None else f"{v:7.1f}"
            print(f"{' '.join(map(str, run['shape'])):24s} {run['variant']:8s} rank {rank}: launch span {fmt(s['span'])} us, "
                  f"gap {fmt(s['gap'])} us, wait/tile {fmt(s['wait'])} us, copy {fmt(s['copy'])} us")"""),
    code("""def plot_run(run, axes):
    launches = run["timelines"]
    t0 = min(l["base_ns"] for l in launches)
    for rank, ax in enumerate(axes):
        top = 0
        bars = {"own": [], "peer": [], "wait": [], "epi": [], "rows": [], "ready": [], "copy": []}
        for l in (l for l in launches if l["rank"] == rank):
            off, pb = (l["base_ns"] - t0) / 1e3, max(1, l["per_block"])
            for t, sm, got, mma, waited, done, rw0, rw1 in l["tile"]:
                if min(got, mma, sm) < 0:
                    continue
                if rw1 > rw0 >= 0:  # AG: the producer waited for the tile's rows
                    bars["rows"].append((sm, off + rw0 / 1e3, (rw1 - rw0) / 1e3))
                own = (t // pb == 0) if l["kind"] == "ag" else (t // pb == l["nranks"] - 1)
                bars["own" if own else "peer"].append((sm, off + got / 1e3, (mma - got) / 1e3))
                if waited > mma:
                    bars["wait"].append((sm, off + mma / 1e3, (waited - mma) / 1e3))
                if done > max(waited, mma):
                    bars["epi"].append((sm, off + max(waited, mma) / 1e3, (done - max(waited, mma)) / 1e3))
                top = max(top, sm + 2)
            if l["kernel"][0] >= 0:
                ax.axvline(off + l["kernel"][0] / 1e3, color="k", lw=0.6, ls=":")
            if abs(l["host_ns"] - l["base_ns"]) < 1e9:
                ax.plot([(l["host_ns"] - t0) / 1e3], [-3], "kv", ms=4)
            for _, a, b, c in l["side_rec"]:
                if min(a, b, c) >= 0:
                    bars["ready"].append((None, off + a / 1e3, (b - a) / 1e3))
                    bars["copy"].append((None, off + b / 1e3, (c - b) / 1e3))
        colors = {"own": "#dd8452", "peer": "#4c72b0", "wait": "#c44e52", "epi": "#8c8c8c",
                  "rows": "#8172b3", "ready": "#c44e52", "copy": "#55a868"}
        for k, v in bars.items():
            if v:
                ys = [top + 2 if y is None else y for y, _, _ in v]
                ax.barh(ys, [max(wd, 0.05) for _, _, wd in v], left=[x for _, x, _ in v],
                        height=(3 if k in ("ready", "copy") else 0.4 if k == "rows" else 0.8),
                        color=colors[k], label=k)
        ax.set_ylim(-5, top + 5)
        ax.set_ylabel(f"rank {rank}: SM")
    axes[-1].set_xlabel("us")

if tl:
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in tl["runs"]))
    for shape in shapes:
        runs = [r for r in tl["runs"] if tuple(r["shape"]) == shape and r["timelines"]]
        if not runs:
            continue
        fig, axes = plt.subplots(2, len(runs), figsize=(5.5 * len(runs), 7), squeeze=False)
        for j, run in enumerate(runs):
            plot_run(run, axes[:, j])
            axes[0, j].set_title(f"{run['variant']}: {run['wall_ms_per_op']:.3f} ms/op", fontsize=9)
        axes[0, 0].legend(fontsize=7, loc="upper right", ncol=3)
        fig.suptitle(f"{shape[0].upper()} {shape[1]}x{shape[2]}x{shape[3]} (global), TP=2")
        fig.tight_layout(); plt.show()"""),
    md("## The fused GEMM alone\n\n"
       "The per-rank GEMM of every benchmark shape on one GPU, with the fused kernel over a one-GPU axis (no "
       "communication) in its 1x1 and 2x1 cluster shapes, against XLA's dot (cuBLAS / Triton): what the "
       "fused op could reach if the communication were entirely hidden."),
    code("""gemm_paths = sorted(p for p in glob.glob(os.path.join(RESULTS, "overlap_gemm_*.json"))
                    if not any(w in os.path.basename(p) for w in ("_exp", "_profile")))
if not gemm_paths:
    print("No GEMM-alone results yet: run `python benchmarks/overlap_gemm.py` on a GPU machine.")
else:
    import matplotlib.pyplot as plt
    g = json.load(open(gemm_paths[-1]))
    print(gemm_paths[-1], g["meta"]["date"], g["meta"]["device"])
    names = ["xla_dot", "fused_1x1", "fused_2x1"]
    labels = [f"{r['kind']} {'x'.join(map(str, r['gemm']))}" for r in g["rows"]]
    fig, ax = plt.subplots(figsize=(12, 4))
    for j, v in enumerate(names):
        ax.bar([i + 0.27 * (j - 1) for i in range(len(labels))],
               [(r["tflops"].get(v) or 0) for r in g["rows"]], width=0.27, label=v)
    ax.set_xticks(range(len(labels))); ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s"); ax.legend(); fig.tight_layout(); plt.show()"""),
]

NOTEBOOKS = {"01_quickstart": quickstart, "02_profiling": profiling, "03_overlap": overlap}
for name in sys.argv[1:] or NOTEBOOKS:
  nb = nbf.v4.new_notebook(cells=NOTEBOOKS[name], metadata={"kernelspec": {
      "name": "python3", "display_name": "Python 3", "language": "python"}})
  nbf.write(nb, f"notebooks/{name}.ipynb")
