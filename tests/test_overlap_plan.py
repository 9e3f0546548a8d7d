"""The fused GEMM's launch plan (xla_ffi/overlap/plan.cc PlanLaunch): tile width, split, cluster, grid.

The plan is made on the host from the shape, the mode bits and the SM count only (so every rank of a
group makes the same one); the extension module exports it, so these run without a GPU wherever
``_dfccl_cuda`` is built with the fused ops (``has_overlap``: CI builds it after the CPU tests and runs
this file).  The kernels
themselves are tested on a GPU (tests/gpu/test_overlap_gemm.py).
"""
from __future__ import annotations

import math

import pytest

ov = pytest.importorskip("jax_dfccl._dfccl_cuda", reason="CUDA backend not built (needs nvcc)")
if not ov.has_overlap:
  pytest.skip("_dfccl_cuda built without the fused overlap ops (needs CUTLASS)", allow_module_level=True)
from jax_dfccl._src import overlap_gpu as og  # noqa: E402

SMS = 132  # an H200
TILE_M = 128


def plan(rows, n, k, nranks=1, avail=SMS, cluster_ctas=SMS, mode=0, kind="ag"):
  return ov.plan(nranks, rows, n, k, avail, cluster_ctas, mode, kind)


def forced(tile_n):
  return (og.TILE_NS.index(tile_n) + 1) << og.MODE_TILE_SHIFT


def whole_tiles(rows, n, tile_n, nranks=1):
  return nranks * math.ceil(rows / TILE_M) * math.ceil(n / tile_n)


SHAPES = [(512, 4096, 7168), (512, 7168, 4096), (1024, 7168, 4096), (4096, 4096, 7168), (8192, 24576, 12288),
          (600, 1040, 1000), (1300, 3600, 512), (96, 272, 136), (1100, 264, 8)]


@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_plan_is_consistent(rows, n, k, nranks):
  """Units, split and grid agree with the tile grid of the chosen width, at every width and in auto."""
  for mode in [0] + [forced(t) for t in og.TILE_NS]:
    p = plan(rows, n, k, nranks, mode=mode)
    assert p["tile_n"] in og.TILE_NS
    if mode:
      assert p["tile_n"] == og.TILE_NS[(mode >> og.MODE_TILE_SHIFT) - 1]
    assert p["tiles"] == whole_tiles(rows, n, p["tile_n"], nranks)
    assert p["units"] == p["tiles"] - p["sk_tiles"] + p["sk_units"]
    if p["sk_units"]:
      assert p["sk_units"] % p["sk_tiles"] == 0 and 2 <= p["sk_units"] // p["sk_tiles"] <= 4
      assert p["sk_tiles"] == p["tiles"] % SMS  # the partial last wave, and only it
      assert p["sk_units"] <= SMS  # one partial slot per SM
    assert 1 <= p["grid"] <= min(SMS, p["units"])
    assert p["cluster_m"] == 1 and p["pdl"] == 1


def test_same_plan_every_time():
  """The choice depends on its arguments only (every rank of a group must compute the same tile grid)."""
  for rows, n, k in SHAPES:
    assert all(plan(rows, n, k) == plan(rows, n, k) for _ in range(3))


def test_narrow_tiles_fill_a_wave_the_wide_ones_leave_half_empty():
  """4 m tiles x 4096 columns: 64 tiles of 256 leave half of 132 SMs idle for 112 k iterations; 128 tiles
  of 128 fill them (measured 0.052 vs 0.059 ms on one H200, overlap_gemm_2026-12-02_h200_tiles_warm.md)."""
  assert plan(512, 4096, 7168)["tile_n"] == 128
  assert plan(512, 4096, 7168, mode=forced(256))["units"] == 128  # 64 tiles split in 2: not a whole wave of work


def test_wide_tiles_where_they_fill_the_wave():
  """One wave either way (112 tiles of 256, or 224 of 128 in two waves): the wider tile streams fewer bytes."""
  assert plan(512, 7168, 4096)["tile_n"] == 256


def test_split_of_a_partial_last_wave():
  """600x1040x1000 at 256 columns: 25 tiles of 16 k iterations, each split into 4 chunks (100 units)."""
  p = plan(600, 1040, 1000, mode=forced(256))
  assert (p["tiles"], p["sk_tiles"], p["sk_units"], p["units"]) == (25, 25, 100, 100)
  no_split = plan(600, 1040, 1000, mode=forced(256) | og.MODE_NO_SPLIT)
  assert (no_split["sk_units"], no_split["units"]) == (0, 25)


def test_clusters():
  """overlap_cluster_m = 2: pairs of m tiles, no split, stream order, an even grid of resident clusters;
  auto (0): 2x1 only for several waves without a split."""
  p = plan(8192, 24576, 12288, mode=og.MODE_CLUSTER_M2 | forced(256))
  assert p["cluster_m"] == 2 and p["sk_units"] == 0 and p["pdl"] == 0
  assert p["units"] == 64 // 2 * 96 and p["grid"] % 2 == 0 and p["grid"] <= SMS
  assert plan(8192, 24576, 12288, cluster_ctas=120, mode=og.MODE_CLUSTER_M2)["grid"] <= 120
  assert plan(8192, 24576, 12288, mode=og.MODE_CLUSTER_AUTO | forced(256))["cluster_m"] == 2
  assert plan(600, 1040, 1000, mode=og.MODE_CLUSTER_AUTO)["cluster_m"] == 1  # split last wave: 1x1
  with pytest.raises(ValueError, match="2x1 cluster"):  # an invalid request, in every module load order
    plan(8192, 24576, 12288, cluster_ctas=0, mode=og.MODE_CLUSTER_M2)


def test_fewer_sms_for_the_gemm():
  """avail: the SMs left to the GEMM (AG push kernels, a copy engine's side kernels) bound the grid and
  the split."""
  p = plan(1300, 3600, 512, avail=100, mode=forced(256))
  assert p["grid"] <= 100 and p["sk_units"] <= 100


# protocol.h kRasters: (m_fast, group_n) of each order config.overlap.raster = 1..6 forces.
RASTERS = [(0, 8), (1, 1), (0, 0), (1, 4), (1, 8), (0, 2)]


def test_tile_order():
  """The default order (n tiles in groups of 8, m outer) unless config.overlap.raster forces one; nothing
  else in the plan changes with the order, and an order outside the table is refused."""
  assert len(RASTERS) == og.RASTERS
  for rows, n, k in SHAPES:
    base = plan(rows, n, k)
    assert (base["m_fast"], base["group_n"]) == RASTERS[0]
    for r, (m_fast, group_n) in enumerate(RASTERS, start=1):
      p = plan(rows, n, k, mode=r << og.MODE_RASTER_SHIFT)
      assert (p["m_fast"], p["group_n"]) == (m_fast, group_n)
      assert {a: v for a, v in p.items() if a not in ("m_fast", "group_n")} == \
          {a: v for a, v in base.items() if a not in ("m_fast", "group_n")}
  with pytest.raises(Exception, match="tile order"):
    plan(1024, 4096, 4096, mode=(len(RASTERS) + 1) << og.MODE_RASTER_SHIFT)


def test_tma_store():
  """config.overlap.tma_store sets the plan's bulk-store flag on 1x1 clusters only (the kernel's TMA variants are
  1x1); nothing else in the plan changes."""
  bit = og.MODE_TMA_STORE
  for rows, n, k in SHAPES:
    base = plan(rows, n, k)
    assert base["tma_store"] == 0
    p = plan(rows, n, k, mode=bit)
    assert p["tma_store"] == 1
    assert {a: v for a, v in p.items() if a != "tma_store"} == {a: v for a, v in base.items() if a != "tma_store"}
    assert plan(rows, n, k, mode=bit | og.MODE_CLUSTER_M2)["tma_store"] == 0


@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("nranks", [1, 2])
def test_pingpong_forced(rows, n, k, nranks):
  """overlap_pingpong=True (kModePingpong): 128-column tiles on 1x1 clusters, the rest of the plan the one of
  forced 128-column tiles (split, units, grid, bulk stores); a forced width other than 128 or 2x1 clusters is
  refused, cluster auto gives 1x1."""
  pp = og.MODE_PINGPONG
  base = plan(rows, n, k, nranks, mode=forced(128))
  assert base["pingpong"] == 0
  for mode in (pp, pp | forced(128), pp | og.MODE_CLUSTER_AUTO):
    p = plan(rows, n, k, nranks, mode=mode)
    assert p["pingpong"] == 1 and p["tile_n"] == 128 and p["cluster_m"] == 1, (mode, p)
    assert {a: v for a, v in p.items() if a != "pingpong"} == {a: v for a, v in base.items() if a != "pingpong"}
  p = plan(rows, n, k, nranks, mode=pp | og.MODE_TMA_STORE_AUTO)
  assert p["tma_store"] == int(p["tiles"] > SMS)
  for bad in (forced(256), forced(192), og.MODE_CLUSTER_M2):
    with pytest.raises(Exception, match="ping-pong"):
      plan(rows, n, k, nranks, mode=pp | bad)
  for mode in (0, og.MODE_CLUSTER_AUTO, og.MODE_TMA_STORE_AUTO, forced(128)):  # never without the bit
    assert plan(rows, n, k, nranks, mode=mode)["pingpong"] == 0


@pytest.mark.parametrize("rows,n,k", SHAPES + [(4096, 7168, 4096), (2048, 4096, 4160), (8192, 4096, 7168)])
@pytest.mark.parametrize("nranks", [1, 2])
@pytest.mark.parametrize("kind", ["ag", "rs"])
def test_tma_store_auto(rows, n, k, nranks, kind):
  """overlap_tma_store=None (kModeTmaStoreAuto): bulk stores exactly where the tiles take more than one wave, on
  1x1 clusters, for tiles of this rank's own output (AG; RS on one rank: RS on several keeps the threads'
  stores, forced or not); the rest of the plan is the one without them."""
  auto = og.MODE_TMA_STORE_AUTO
  base, p = plan(rows, n, k, nranks, kind=kind), plan(rows, n, k, nranks, mode=auto, kind=kind)
  assert {a: v for a, v in p.items() if a != "tma_store"} == {a: v for a, v in base.items() if a != "tma_store"}
  tiles = whole_tiles(rows, n, p["tile_n"], nranks)
  assert p["tiles"] == tiles
  own = kind == "ag" or nranks == 1
  assert p["tma_store"] == int(own and tiles > SMS)
  assert plan(rows, n, k, nranks, mode=auto | og.MODE_CLUSTER_M2, kind=kind)["tma_store"] == 0
  assert plan(rows, n, k, nranks, mode=auto | og.MODE_TMA_STORE, kind=kind)["tma_store"] == int(own)  # forced wins


def test_tma_store_auto_examples():
  """Measured cases the rule was drawn from (overlap_gemm_2026-12-03_h200_tma{,_auto}.md)."""
  auto = og.MODE_TMA_STORE_AUTO
  assert plan(4096, 7168, 4096, mode=auto)["tma_store"] == 1   # 3.5 waves, K = 4096: 0.94x
  assert plan(512, 7168, 4096, mode=auto)["tma_store"] == 0    # one wave: 1.069x
  assert plan(1024, 4096, 7168, mode=auto)["tma_store"] == 0   # 128 tiles, one wave: 1.013-1.017x
  assert plan(8192, 4096, 7168, mode=auto)["tma_store"] == 1   # 8 waves: 0.983x


@pytest.mark.parametrize("nranks", [1, 2])
def test_plan_needs_a_kind(nranks):
  """The plan is per op kind (the bulk stores are for tiles of the rank's own output); other kinds are refused."""
  assert plan(1024, 4096, 4096, nranks, kind="ag") == plan(1024, 4096, 4096, nranks, kind="rs")  # no bulk stores
  with pytest.raises(Exception, match="kind"):
    plan(1024, 4096, 4096, nranks, kind="ar")
