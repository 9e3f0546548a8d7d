"""CPU tests of the overlap tooling: mode bits, profile-result parsing, the benchmark's shape
grid, chain sizing and target columns (the GPU paths themselves run under `pytest -m gpu`)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import types

import pytest

from jax_dfccl._src import overlap_gpu as og
from jax_dfccl.config import Config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
  spec = importlib.util.spec_from_file_location("overlap_bench", ROOT / "benchmarks" / "overlap.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _cfg(**kw):
  base = dict(overlap_copy_engine=True, overlap_cta_fence=True, overlap_rs_copy_engine_min_bytes=8 << 20,
              overlap_cluster_m=1, overlap_split_last_wave=True, overlap_pdl=True, overlap_tile_n=0, overlap_raster=0,
              overlap_tma_store=False, overlap_pingpong=False)
  base.update(kw)
  # jax_dfccl.config's shape: the overlap switches in their section, without the prefix
  return types.SimpleNamespace(overlap=types.SimpleNamespace(**{k.removeprefix("overlap_"): v for k, v in base.items()}))


def test_mode_bits():
  assert og._mode(_cfg(), "ag", 2, 1 << 30) == 1 | 2
  assert og._mode(_cfg(), "rs", 2, 4 << 20) == 1 | 2            # 4 MiB block: SM stores
  assert og._mode(_cfg(), "rs", 2, 8 << 20) == 1 | 2 | 4        # 8 MiB: copy engine
  assert og._mode(_cfg(), "rs", 4, 1 << 30) == 1 | 2            # copy engine only for 2 ranks
  assert og._mode(_cfg(overlap_rs_copy_engine_min_bytes=-1), "rs", 2, 1 << 30) == 1 | 2
  with og.diag_mode(og.MODE_MAILBOX_ONLY):
    assert og._mode(_cfg(overlap_copy_engine=False, overlap_cta_fence=False), "ag", 2, 0) == 8
  assert og._mode(_cfg(overlap_copy_engine=False, overlap_cta_fence=False), "ag", 2, 0) == 0


def test_mode_cluster_bit():
  assert og.MODE_CLUSTER_M2 == 16
  assert og._mode(_cfg(overlap_cluster_m=2), "ag", 2, 0) == 1 | 2 | 16
  assert og._mode(_cfg(overlap_cluster_m=2), "rs", 2, 8 << 20) == 1 | 2 | 4 | 16
  assert og._mode(_cfg(overlap_cluster_m=1), "rs", 2, 8 << 20) == 1 | 2 | 4
  assert og._mode(_cfg(overlap_cluster_m=0), "ag", 2, 0) == 1 | 2 | 64  # auto: the host picks
  for bad in (-1, 3, 4, True, "2", 2.0):
    with pytest.raises(ValueError, match="overlap.cluster_m"):
      og._mode(_cfg(overlap_cluster_m=bad), "ag", 2, 0)


def test_mode_split_bit():
  assert og.MODE_NO_SPLIT == 32
  assert og._mode(_cfg(overlap_split_last_wave=False), "ag", 2, 0) == 1 | 2 | 32
  assert og._mode(_cfg(overlap_split_last_wave=False, overlap_cluster_m=2), "rs", 2, 8 << 20) == 1 | 2 | 4 | 16 | 32
  assert og._mode(_cfg(), "ag", 2, 0) & 32 == 0


def test_mode_pdl_bit():
  assert og.MODE_NO_PDL == 128
  assert og._mode(_cfg(overlap_pdl=False), "ag", 2, 0) == 1 | 2 | 128
  assert og._mode(_cfg(overlap_pdl=False, overlap_split_last_wave=False), "rs", 4, 0) == 1 | 2 | 32 | 128
  assert og._mode(_cfg(), "rs", 2, 0) & 128 == 0


def test_mode_tile_bits():
  """overlap_tile_n: 0 leaves the choice to the host; a width is forced as 1 + its index in TILE_NS."""
  assert og._mode(_cfg(), "ag", 2, 0) >> og.MODE_TILE_SHIFT == 0
  for i, t in enumerate(og.TILE_NS):
    assert og._mode(_cfg(overlap_tile_n=t), "ag", 2, 0) == 1 | 2 | ((i + 1) << og.MODE_TILE_SHIFT)
  for bad in (64, 100, True, 512, 128.0):
    with pytest.raises(ValueError, match="overlap.tile_n"):
      og._mode(_cfg(overlap_tile_n=bad), "rs", 2, 0)


def test_mode_constants_match_protocol_h():
  """The Python mode bits are the enum of xla_ffi/overlap/protocol.h (the kernels' side)."""
  import re
  text = (ROOT / "xla_ffi" / "overlap" / "protocol.h").read_text()
  enum = dict((name, int(v)) for name, v in re.findall(r"\bkMode(\w+) = (\d+)", text))
  py = {"MailboxOnly": og.MODE_MAILBOX_ONLY, "ClusterM2": og.MODE_CLUSTER_M2, "NoSplit": og.MODE_NO_SPLIT,
        "ClusterAuto": og.MODE_CLUSTER_AUTO, "NoPdl": og.MODE_NO_PDL}
  assert {k: enum[k] for k in py} == py
  assert enum["TileShift"] == og.MODE_TILE_SHIFT and enum["TileMask"] == 3 << og.MODE_TILE_SHIFT
  widths = re.search(r"kTileNs\[\] = \{([^}]*)\}", text).group(1)
  assert tuple(int(v) for v in widths.split(",")) == og.TILE_NS
  assert enum["CopyEngine"] == 1 and enum["CtaFence"] == 2 and enum["RsCopyEngine"] == 4  # _mode's literals
  assert enum["RasterShift"] == og.MODE_RASTER_SHIFT and enum["RasterMask"] == 7 << og.MODE_RASTER_SHIFT
  assert enum["TmaStore"] == og.MODE_TMA_STORE and og.MODE_TMA_STORE > enum["RasterMask"]
  assert enum["TmaStoreAuto"] == og.MODE_TMA_STORE_AUTO == 2 * og.MODE_TMA_STORE
  assert enum["Pingpong"] == og.MODE_PINGPONG == 2 * og.MODE_TMA_STORE_AUTO
  rasters = re.search(r"kRasters\[\] = \{(.*)\};", text).group(1)
  assert len(re.findall(r"\{[^}]*\}", rasters)) == og.RASTERS < 8  # 1 + index fits the 3 bits


def test_mode_tma_store_bits():
  """overlap_tma_store: None (default) asks the plan, True / False force; anything else is refused."""
  assert og._mode(_cfg(overlap_tma_store=True), "ag", 2, 0) == 1 | 2 | og.MODE_TMA_STORE
  assert og._mode(_cfg(overlap_tma_store=False), "ag", 2, 0) == 1 | 2
  assert og._mode(_cfg(overlap_tma_store=None), "ag", 2, 0) == 1 | 2 | og.MODE_TMA_STORE_AUTO
  assert Config().overlap.tma_store is None
  for bad in (1, 0, "on", 1.0):
    with pytest.raises(ValueError, match="overlap.tma_store"):
      og._mode(_cfg(overlap_tma_store=bad), "rs", 1, 0)


def test_mode_pingpong_bits():
  """overlap_pingpong: False (default) the cooperative schedule, True ping-pong; True with another tile width than
  128 or with 2x1 clusters, and anything but a bool, are refused at trace time."""
  assert og._mode(_cfg(overlap_pingpong=True), "ag", 2, 0) == 1 | 2 | og.MODE_PINGPONG
  assert og._mode(_cfg(overlap_pingpong=True, overlap_tile_n=128, overlap_cluster_m=0), "rs", 2, 0) == \
      1 | 2 | og.MODE_PINGPONG | og.MODE_CLUSTER_AUTO | (1 << og.MODE_TILE_SHIFT)
  assert og._mode(_cfg(overlap_pingpong=False), "ag", 2, 0) == 1 | 2
  assert Config().overlap.pingpong is False
  for bad in (1, 0, "on", None):
    with pytest.raises(ValueError, match="overlap.pingpong"):
      og._mode(_cfg(overlap_pingpong=bad), "rs", 1, 0)
  for kw in (dict(overlap_tile_n=256), dict(overlap_tile_n=192), dict(overlap_cluster_m=2)):
    with pytest.raises(ValueError, match="overlap.pingpong=True runs 128-column tiles"):
      og._mode(_cfg(overlap_pingpong=True, **kw), "ag", 2, 0)
    og._mode(_cfg(overlap_pingpong=False, **kw), "ag", 2, 0)


def test_mode_raster_bits():
  """overlap_raster: 0 leaves the plan's tile order; 1..RASTERS force kRasters[v - 1]; others are refused."""
  assert og._mode(_cfg(), "ag", 2, 0) >> og.MODE_RASTER_SHIFT == 0
  for r in range(1, og.RASTERS + 1):
    assert og._mode(_cfg(overlap_raster=r), "rs", 2, 0) == 1 | 2 | (r << og.MODE_RASTER_SHIFT)
  for bad in (-1, og.RASTERS + 1, True, 2.0):
    with pytest.raises(ValueError, match="overlap.raster"):
      og._mode(_cfg(overlap_raster=bad), "ag", 2, 0)


def _lower_for_cuda(kind):
  """StableHLO of one fused op on 2 ranks, lowered for CUDA on the CPU host (no GPU)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jax_dfccl._src import overlap as ov
  mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
  if kind == "ag":
    op, specs, out = ov.all_gather_matmul, (P("tp", None), P(None, "tp")), P(None, "tp")
    shapes = ((2 * 200, 136), (136, 2 * 136))
  else:
    op, specs, out = ov.matmul_reduce_scatter, (P(None, "tp"), P("tp", None)), P("tp", None)
    shapes = ((2 * 200, 2 * 72), (2 * 72, 136))
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, sp)) for s, sp in zip(shapes, specs)]
  f = jax.jit(jax.shard_map(lambda x, w: op(x, w, "tp"), mesh=mesh, in_specs=specs, out_specs=out))
  return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("cluster_m", [1, 2])
def test_lowering_for_cuda_carries_the_cluster_bit(monkeypatch, kind, cluster_m):
  """overlap_cluster_m is read at trace time into the custom call's `mode` (CPU host, CUDA lowering)."""
  from jax_dfccl.config import config
  monkeypatch.setattr(og, "available", lambda: True)
  monkeypatch.setattr(config.overlap, "cluster_m", cluster_m)
  monkeypatch.setattr(config.overlap, "rs_copy_engine_min_bytes", -1)
  text = _lower_for_cuda(kind)
  assert f"dfccl_overlap_{kind}" in text
  defaults = og.MODE_TMA_STORE_AUTO
  assert f"mode = {1 | 2 | (16 if cluster_m == 2 else 0) | defaults} : i32" in text


def test_lowering_rejects_a_bad_cluster_m(monkeypatch):
  from jax_dfccl.config import config
  monkeypatch.setattr(og, "available", lambda: True)
  monkeypatch.setattr(config.overlap, "cluster_m", 4)
  with pytest.raises(ValueError, match=r"overlap.cluster_m must be 0 \(auto\), 1 or 2"):
    _lower_for_cuda("rs")


def test_profile_results_parsing(monkeypatch):
  raw = {"key": "rs:1024x7168@7168x4096", "rank": 1, "kind": "rs", "tiles": 2, "base_ns": 5,
         "kernel": [0, 10], "tile": [[0, 3, 0, 50, 60, 70, -1, -1]], "side_rec": []}

  class Fake:
    def _profile_results(self):
      return [("rs:1024x7168@7168x4096|gemm", 0.1), ("rs:1024x7168@7168x4096|tl_span", 0.07),
              ("rs:1024x7168@7168x4096|tlraw|" + json.dumps(raw), 0.07)]

  monkeypatch.setattr(og, "module", lambda: Fake())
  res = og.profile_results()
  assert res["events"] == [("rs:1024x7168@7168x4096|gemm", 0.1), ("rs:1024x7168@7168x4096|tl_span", 0.07)]
  assert res["timelines"] == [raw]


def test_profile_needs_the_module(monkeypatch):
  monkeypatch.setattr(og, "module", lambda: None)
  with pytest.raises(RuntimeError, match="not available"):
    og.profile(True)
  assert og.profile_results() == {"events": [], "timelines": []}


def _args(**kw):
  base = dict(ops=["ag", "rs"], m=[1024, 4096, 8192], nk=[0, 1, 2], scale=1, limit=0)
  base.update(kw)
  return argparse.Namespace(**base)


def test_benchmark_covers_the_issue_grid():
  b = _bench()
  s = b.shapes(_args())
  assert len(s) == 18 and len(set(s)) == 18
  assert s[:6] == [("ag", 1024, 14336, 4096), ("rs", 1024, 4096, 14336), ("ag", 4096, 14336, 4096),
                   ("rs", 4096, 4096, 14336), ("ag", 8192, 14336, 4096), ("rs", 8192, 4096, 14336)]
  assert ("ag", 8192, 49152, 12288) in s and ("rs", 1024, 12288, 49152) in s
  assert b.shapes(_args(ops=["rs"], m=[1024], nk=[0], scale=64)) == [("rs", 16, 64, 224)]


def test_benchmark_chain_sizes():
  b = _bench()
  small, est_small = b.plan("ag", 1024, 14336 // 2, 4096)
  big, est_big = b.plan("ag", 8192, 49152 // 2, 12288)
  assert 2 <= big <= small <= 8 and est_big > 10 * est_small


def test_benchmark_row_targets():
  b = _bench()
  r = b._row(("rs", 1024, 4096, 14336), {"t_gemm": 0.10, "t_comm": 0.05, "xla_plain": 0.30,
                                        "xla_windowed": 0.25, "ours_fused": 0.104})
  assert r["bytes_moved_per_rank"] == 512 * 4096 * 2
  assert r["bound"] == pytest.approx(0.10)
  assert r["ours_over_max"] == pytest.approx(1.04) and r["xla_over_ours"] == pytest.approx(0.25 / 0.104)
  assert b._md(("rs", 1024, 4096, 14336), r, llama=True)[-1] == "✓✓"
  slow = b._row(("ag", 1024, 14336, 4096), {"t_gemm": 0.1, "xla_plain": 0.11, "ours_fused": 0.12})
  assert b._md(("ag", 1024, 14336, 4096), slow, llama=True)[-1] == "✗✗"
  none = b._row(("ag", 1024, 14336, 4096), {"t_gemm": 0.1})
  assert none["ours"] is None and b._md(("ag", 1024, 14336, 4096), none, llama=True)[-1] == "—"


def _gemm_bench():
  spec = importlib.util.spec_from_file_location("overlap_gemm_bench", ROOT / "benchmarks" / "overlap_gemm.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_paired_ratios():
  """benchmarks/overlap_gemm.py's paired ratio: per rep ours / XLA's of the same rep, median over reps; a
  drift that slows every variant of a rep alike cancels (the ratio of the medians would keep some)."""
  mod = _gemm_bench()
  drift = [1.0, 1.05, 0.96, 1.02, 1.08]  # the GPU's state per rep
  per_rep = {"xla_dot": [0.100 * d for d in drift], "fused_1x1": [0.103 * d for d in drift],
             "fused_t256": [0.110 * d for d in drift[::-1]]}
  got = mod.paired_ratios(per_rep)
  assert set(got) == {"fused_1x1", "fused_t256"}
  assert got["fused_1x1"] == pytest.approx(1.03)
  assert got["fused_t256"] == pytest.approx(statistics.median(0.110 * a / (0.100 * b)
                                                              for a, b in zip(drift[::-1], drift)))
  assert mod.paired_ratios({"fused_1x1": [1.0]}) == {}


def test_cutlass_probe_output_joins_the_rows():
  """benchmarks/overlap_gemm.py --cutlass-probe: the probe's output (a committed run of it, 22 shapes x 7
  configurations) parsed per shape; each row gets the fastest configuration and its ratio to the row's XLA dot,
  checked against a parse of the same lines done here."""
  mod = _gemm_bench()
  text = (ROOT / "benchmarks" / "results" / "cutlass_gemm_probe_2026-12-03_h200_steady22.log").read_text()
  got = mod.parse_cutlass_probe(text)
  assert len(got) == 22 and all(len(v) == 7 for v in got.values())
  ref, shape = {}, None
  for line in text.splitlines():
    if line and line[0].isdigit():
      shape = line.strip()
    elif line.startswith("  ") and " us " in line:
      ref.setdefault(shape, {})[line[:38].strip()] = float(line[38:].split()[0])
  assert got == ref
  assert got["512x7168x4096"]["coop 128x256x64 cluster 1x1"] == 49.2
  rows = [{"gemm": [512, 7168, 4096], "ms": {"xla_dot": 0.0492}}, {"gemm": [7, 7, 7], "ms": {}}]
  mod.add_cutlass(rows, got)
  best = min(ref["512x7168x4096"].values())
  assert rows[0]["cutlass_best"]["ms"] == pytest.approx(best / 1e3)
  assert ref["512x7168x4096"][rows[0]["cutlass_best"]["config"]] == best
  assert rows[0]["cutlass_best"]["vs_xla_dot"] == pytest.approx(best / 49.2)
  assert "cutlass_best" not in rows[1]  # a shape the probe did not time
  assert mod.parse_cutlass_probe("1x2x3\n  coop 128x256x64 cluster 1x1   cannot implement\n") == {"1x2x3": {}}


def test_xla_dot_impl_names_the_library_and_the_tiling():
  """benchmarks/overlap_gemm.py records what XLA made of its dot: a cuBLAS call, a Triton GEMM (both forms of
  its backend config; a nested GEMM's operand fusions, which carry the same kind, not counted), cuDNN, or
  XLA's own dot; checked on HLO lines in XLA's text format and on a dot compiled here."""
  mod = _gemm_bench()
  cublas = ('  %cublas-gemm.1 = (bf16[1024,4096]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1), '
            'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1}}')
  assert mod.xla_dot_impl(cublas + "\n" + cublas) == {"impl": "cublas", "target": "__cublas$lt$matmul", "gemms": 2}
  legacy = ('  ROOT %f = bf16[1024,4096]{1,0} fusion(%a, %b), kind=kCustom, calls=%triton_gemm_dot, '
            'backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_gemm",'
            '"triton_gemm_config":{"block_m":"128","block_n":"128","block_k":"64","split_k":"1","num_stages":"3",'
            '"num_warps":"4","num_ctas":"1"}},"force_earliest_schedule":false}')
  assert mod.xla_dot_impl(legacy) == {"impl": "triton", "config": "128x128x64, split_k 1, 3 stages, 4 warps",
                                      "gemms": 1}
  operand = ('  %block_fusion = bf16[1024,7168]{1,0} fusion(%parameter_0), kind=kCustom, calls=%parameter_0, '
             'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":'
             '{"num_warps":"8","output_tiles":[{"sizes":["128","64"]}],"num_ctas":1,"num_stages":4}}}')
  outer = ('  %gemm_fusion_dot_general_2 = bf16[1024,4096]{1,0} fusion(%x, %w), kind=kCustom, '
           'calls=%gemm_fusion_dot_general_2_computation, metadata={op_name="jit(f)/dot_general"}, '
           'backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"fusion_backend_config":'
           '{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":{"num_warps":"4","output_tiles":'
           '[{"sizes":["128","128"]}],"num_ctas":1,"num_stages":3,"is_tma_allowed":true}},"reification_cost":[]}')
  got = mod.xla_dot_impl("\n".join([operand, operand, outer, operand, outer]))
  assert got == {"impl": "triton", "config": "128x128, 3 stages, 4 warps", "gemms": 2}
  cudnn = '  %f = bf16[8,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%c, backend_config={"fusion_backend_config":{"kind":"__cudnn$fusion"}}'
  assert mod.xla_dot_impl(cudnn) == {"impl": "cudnn", "gemms": 1}
  assert mod.xla_dot_impl("  %a = f32[2]{0} add(%x, %y)") is None
  import jax
  import jax.numpy as jnp
  x = jnp.ones((64, 32), jnp.float32)
  text = jax.jit(lambda x, w: jnp.dot(jnp.dot(x, w), w.T)).lower(x, x.T).compile().as_text()
  got = mod.xla_dot_impl(text)
  assert got is not None and got["gemms"] >= 1, text[:2000]


def test_gemm_kernel_stats():
  """The trace summary of benchmarks/overlap_gemm.py --profile and tools/gemm_power_probe.py --trace: the kernel
  with the most time is the GEMM; its duration, gaps and start-to-start periods by hand."""
  mod = _gemm_bench()
  evs = [("gemm", 0.0, 10.0), ("copy", 10.5, 1.0), ("gemm", 12.0, 10.0), ("gemm", 21.0, 11.0)]  # a PDL overlap
  s = mod.gemm_kernel_stats(evs)
  assert s["kernel"] == "gemm" and s["kernels"] == 3 and s["kernel_us"] == 10.0
  assert s["gap_us"] == statistics.median([2.0, -1.0]) and s["period_us"] == statistics.median([12.0, 9.0])
  assert s["max_period_us"] == 12.0 and s["other_activities"] == {"copy": 1}
  assert mod.gemm_kernel_stats([]) is None


def _common():
  spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_benchmarks_name_their_gpu_instance(monkeypatch):
  """benchmarks/common.py gpu_instance(): each GPU's PCI bus, power limit, max SM clock and temperature from
  nvidia-smi's CSV (rows of another width are skipped); None where nvidia-smi is missing."""
  c = _common()
  text = ("0, NVIDIA H200, 00000000:00:06.0, 700.00 W, 1980 MHz, 31\n"
          "1, NVIDIA H200, 00000000:00:07.0, 700.00 W, 1980 MHz, 33\nnot, a row\n")
  rows = c.parse_gpu_query(text)
  assert [r["pci.bus_id"] for r in rows] == ["00000000:00:06.0", "00000000:00:07.0"]
  assert rows[0] == {"index": "0", "name": "NVIDIA H200", "pci.bus_id": "00000000:00:06.0",
                     "power.limit": "700.00 W", "clocks.max.sm": "1980 MHz", "temperature.gpu": "31"}
  import shutil
  monkeypatch.setattr(shutil, "which", lambda name: None)
  assert c.gpu_instance() is None and "gpus" not in c.header("x")


def test_kernel_timeline_and_trace_events(tmp_path):
  """benchmarks/common.py: gpu_kernel_events reads a jax.profiler trace (the GPU process's complete events only,
  by start); kernel_timeline's period, durations and gaps by hand."""
  import gzip
  import json
  c = _common()
  trace = {"traceEvents": [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
      {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
      {"ph": "X", "pid": 1, "name": "host", "ts": 0.0, "dur": 50.0},
      {"ph": "X", "pid": 2, "name": "mul", "ts": 4.0, "dur": 1.0},
      {"ph": "X", "pid": 2, "name": "InlineSubmitKernel", "ts": 0.0, "dur": 3.0},
      {"ph": "X", "pid": 2, "name": "InlineSubmitKernel", "ts": 7.0, "dur": 3.0},
      {"ph": "X", "pid": 2, "name": "mul", "ts": 12.0, "dur": 1.0},
      {"ph": "X", "pid": 2, "name": "InlineSubmitKernel", "ts": 16.0, "dur": 2.0},
      {"ph": "i", "pid": 2, "name": "marker", "ts": 1.0}]}
  d = tmp_path / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  with gzip.open(d / "host.trace.json.gz", "wt") as fh:
    json.dump(trace, fh)
  evs = c.gpu_kernel_events(str(tmp_path))
  assert [e[0] for e in evs] == ["InlineSubmitKernel", "mul", "InlineSubmitKernel", "mul", "InlineSubmitKernel"]
  t = c.kernel_timeline(evs, "Submit")
  assert t["ops"] == 3 and t["period_us"] == statistics.median([7.0, 9.0])
  assert t["kernels"]["InlineSubmitKernel"] == {"count": 3, "median_us": 3.0}
  assert t["kernels"]["mul"] == {"count": 2, "median_us": 1.0}
  assert t["gaps"]["InlineSubmitKernel -> mul"] == {"count": 2, "median_us": statistics.median([1.0, 2.0])}
  assert t["gaps"]["mul -> InlineSubmitKernel"] == {"count": 2, "median_us": statistics.median([2.0, 3.0])}
  assert c.kernel_timeline(evs, "nothing") is None


def test_donated_time_settles_then_times():
  """benchmarks/common.py donated_time: one call on a copy and an untimed round of `depth`, then
  `reps` timed rounds, each call fed the last output (the input itself stays valid); on_settled
  runs once, between the settling round and the timed ones."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  c = _common()
  calls, marks = [], []
  f = jax.jit(lambda v: v + 1.0, donate_argnums=0)

  def fn(v):
    calls.append(1)
    return f(v)
  x = jnp.zeros(4)
  t = c.donated_time(fn, x, reps=3, depth=5, on_settled=lambda: marks.append(len(calls)))
  assert t > 0 and marks == [6] and len(calls) == 6 + 3 * 5
  np.testing.assert_array_equal(np.asarray(x), np.zeros(4))  # not donated: a copy was
