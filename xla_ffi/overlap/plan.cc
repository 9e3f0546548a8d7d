// The launch plan of a fused GEMM (plan.h): tile width, split of a partial
// last wave, cluster shape, units and grid, from the shape, the mode bits and
// the device alone.
#include "overlap/plan.h"

#include <algorithm>
#include <iterator>

#include "dfccl/check.h"

namespace dfccl::overlap {
namespace {

// The GEMM's cluster variant (kModeClusterM2: 2x1, GemmLaunch::cluster_m).
int ClusterM(int32_t mode) { return (mode & kModeClusterM2) ? 2 : 1; }

// Work units of the GEMM (gemm_sched.cuh): cm m tiles of a row block x one n tile.
int Units(int nranks, int mtiles, int ntiles, int cm) { return nranks * ((mtiles + cm - 1) / cm) * ntiles; }

// Grid of the persistent GEMM: at most `avail` CTAs (the SMs left to it) and
// one per unit; cm = 2 whole clusters only, no more than are resident at once.
int GemmGrid(int cluster_ctas, int avail, int units, int cm) {
  if (cm == 1) return std::max(1, std::min(avail, units));
  DFCCL_CHECK(cluster_ctas >= 2, "dfccl overlap: no 2x1 cluster of the GEMM fits on the device");
  return std::max(2, std::min({avail, 2 * units, cluster_ctas}) & ~1);
}

// Work units of one launch (gemm_sched.cuh): whole tiles, and with a split
// last wave the last sk_tiles tiles split into sk_units / sk_tiles chunks.
struct Sched {
  int units = 0, sk_units = 0, sk_tiles = 0;
};

// Split of a partial last wave (cluster_m = 1, not kModeNoSplit): with
// `avail` resident CTAs, `tiles` whole tiles of k_tiles iterations take
// ceil(tiles / avail) waves of tile time.  The remainder R = tiles mod avail
// (the last wave) split into s = min(avail / R, kSkMaxSplit, k_tiles /
// kSkMinIters) chunks of k takes 1 / s of a wave, times kSkCost (the partials
// stored and added, the shorter mainloops).  Chosen when s >= 2 and that
// estimate is at most kSkGain of the whole-tile one.  Same shape, same device:
// the same choice on every rank.  (A stream-K split, R tiles' iterations laid
// end to end over `avail` units, also fills a last wave with R > avail / 2,
// but its units read the weights at different k offsets per m tile: measured
// slower, 0.065 vs 0.054 ms for 512x7168x4096 on one H200.)
constexpr int kSkMinIters = 4;   // k iterations of a chunk at least (pipeline depth)
constexpr int kSkMaxSplit = 4;   // chunks of a tile at most (partials added by its owner)
constexpr double kSkCost = 1.1;  // a wave of chunks against a wave of whole tiles
constexpr double kSkGain = 0.95;
Sched Schedule(int tiles, int avail, int k_tiles, int32_t mode) {
  Sched s;
  s.units = tiles;
  if ((mode & kModeNoSplit) || avail < 2) return s;
  const int full = tiles / avail, rem = tiles % avail;
  if (rem == 0) return s;
  const int split = std::min({avail / rem, kSkMaxSplit, k_tiles / kSkMinIters});
  if (split < 2) return s;
  if (full + kSkCost / split > kSkGain * (full + 1)) return s;
  s.sk_tiles = rem;
  s.sk_units = rem * split;
  s.units = tiles - rem + s.sk_units;
  return s;
}

// Estimated time of a launch (us) at one tile width: every wave costs a fixed
// part (prologue, epilogue) and the k iterations of its units; a split last
// wave costs its chunk's iterations and the partials' store and add.  The
// constants are least-squares fits, per width, of the GEMM alone on one H200
// over the 22 shapes of benchmarks/overlap_gemm.py, every width forced, each
// timed in its own steady state (overlap_gemm_2026-12-02_h200_tiles_warm.json;
// 192 from overlap_gemm_2026-12-02_h200_tiles.json, scaled per shape by the
// two runs' ratio at 256).  The estimate is within 6% of every measurement
// and picks the fastest width, or one within 0.2% of it, on all 22 shapes.
// Only the ratios between widths matter for the choice.
struct TileCost {
  double wave_us, iter_us, split_us;
};
constexpr TileCost kTileCost[] = {{1.112, 0.4284, 8.534}, {2.959, 0.6166, 6.790}, {2.166, 0.8246, 10.607}};  // kTileNs
static_assert(std::size(kTileCost) == std::size(kTileNs), "a cost per tile width");
double EstimateUs(const Sched& s, int tiles, int avail, int k_tiles, const TileCost& c) {
  const int full = tiles / avail, rem = tiles % avail;
  if (s.sk_units > 0)
    return (full + 1) * c.wave_us + (full * k_tiles + double(k_tiles) * s.sk_tiles / s.sk_units) * c.iter_us +
           c.split_us;
  return (full + (rem != 0 ? 1 : 0)) * (c.wave_us + k_tiles * c.iter_us);
}

// Tile width of a launch (GemmLaunch::tile_n): forced by the mode bits, else
// the width of kTileNs with the least EstimateUs (with the split Schedule
// picks for it).  n is the GEMM's column count, avail >= 1.  Depends only on the shape,
// the mode and the SMs, so every rank of a group picks the same.
int ChooseTileN(int nranks, int mtiles, int n, int k_tiles, int avail, int32_t mode) {
  const int forced = (mode & kModeTileMask) >> kModeTileShift;
  if (forced > 0) return kTileNs[forced - 1];
  int best = kTileNMax;
  double best_us = 0;
  for (size_t i = 0; i < std::size(kTileNs); ++i) {
    const int tn = kTileNs[i], tiles = nranks * mtiles * ((n + tn - 1) / tn);
    const double us = EstimateUs(Schedule(tiles, avail, k_tiles, mode), tiles, avail, k_tiles, kTileCost[i]);
    if (i == 0 || us < best_us) best = tn, best_us = us;
  }
  return best;
}

// The ping-pong schedule (LaunchPlan::pingpong): only where kModePingpong
// asks for it (config overlap_pingpong), with 128-column tiles and 1x1
// clusters (another forced width or 2x1 clusters is an error).  Not picked
// per shape: on one H200, the GEMM alone, 22 shapes, two runs, it was slower
// than the default plan on 19 of them in each (median 1.06x XLA's dot;
// 128-column tiles move a third more operand bytes per flop than 256-column
// ones) and not faster beyond the run-to-run spread on any
// (overlap_gemm_2026-12-04_h200_{pingpong2,widths}.md).  What it may hide
// with communication (a peer's partial stored over NVLink by one group
// while the other computes) is measured on two GPUs.
constexpr int kPingpongTileN = 128;
bool Pingpong(int32_t mode) {
  if (!(mode & kModePingpong)) return false;
  const int forced = (mode & kModeTileMask) >> kModeTileShift;
  DFCCL_CHECK(forced == 0 || kTileNs[forced - 1] == kPingpongTileN,
              "dfccl overlap: the ping-pong schedule takes 128-column tiles, not " << kTileNs[forced - 1]);
  DFCCL_CHECK(!(mode & kModeClusterM2), "dfccl overlap: the ping-pong schedule runs on 1x1 clusters");
  return true;
}

}  // namespace

// Tile width, cluster shape, units and grid of a launch (plan.h).
// kModeClusterAuto (config overlap_cluster_m = 0): 1x1 when the last wave is
// split or the tiles fit in one wave, else 2x1 (one H200, the GEMM alone: 2x1
// within the run-to-run spread of 1x1 on the multi-wave benchmark shapes, 0-3%
// ahead on most in overlap_gemm_2026-12-01_h200_configs_rot.md).
LaunchPlan PlanLaunch(int32_t kind, int nranks, int rows, int n, int k, int avail, int cluster_ctas, int32_t mode) {
  DFCCL_CHECK(kind == kAllGatherGemm || kind == kGemmReduceScatter, "dfccl overlap: no op kind " << kind);
  LaunchPlan p;
  avail = std::max(1, avail);
  const int mtiles = (rows + kTileM - 1) / kTileM, k_tiles = (k + 63) / 64;
  p.pingpong = Pingpong(mode) ? 1 : 0;
  p.tile_n = p.pingpong ? kPingpongTileN : ChooseTileN(nranks, mtiles, n, k_tiles, avail, mode);
  const int ntiles = (n + p.tile_n - 1) / p.tile_n, tiles = nranks * mtiles * ntiles;
  Sched s = Schedule(tiles, avail, k_tiles, mode);  // 1x1 units
  p.cluster_m = p.pingpong ? 1 : ClusterM(mode);
  if ((mode & kModeClusterAuto) && !p.pingpong)
    p.cluster_m = s.sk_units == 0 && tiles > avail && cluster_ctas >= 2 ? 2 : 1;
  if (p.cluster_m != 1) s = Sched{Units(nranks, mtiles, ntiles, p.cluster_m), 0, 0};
  p.tiles = tiles;
  p.units = s.units;
  p.sk_units = s.sk_units;
  p.sk_tiles = s.sk_tiles;
  // Programmatic launch on 1x1 clusters only: with 2x1 clusters it made the
  // GEMM slower (one H200, the GEMM alone: 0.460 vs 0.368 ms for 4096x7168x4096,
  // overlap_gemm_2026-12-02_h200_pdl.md); stream order there.
  p.pdl = (mode & kModeNoPdl) || p.cluster_m != 1 ? 0 : 1;
  p.grid = GemmGrid(cluster_ctas, avail, p.units, p.cluster_m);
  const int raster = (mode & kModeRasterMask) >> kModeRasterShift;
  DFCCL_CHECK(raster <= int(std::size(kRasters)), "dfccl overlap: no tile order " << raster);
  if (raster > 0) p.raster = kRasters[raster - 1];
  // Bulk tensor stores: forced (kModeTmaStore), or picked (kModeTmaStoreAuto)
  // where the tiles take more than one wave, so the next tile hides a tile's
  // stores.  One H200, the GEMM alone, 22 shapes, two runs, against the
  // threads' stores per rep (overlap_gemm_2026-12-03_h200_tma{,_auto}.md):
  // multi-wave 0.95-0.97x at K = 4096, 0.97-1.02x (mean 0.995) at larger K;
  // single-wave 0.99-1.07x (the stores of a CTA's one tile end the kernel).
  // Only tiles whose destination is this rank's own output take them (AG; RS
  // on one rank): RS on several ranks keeps the threads' stores.
  const bool tma_auto = (mode & kModeTmaStoreAuto) && tiles > avail;
  const bool own_output = kind == kAllGatherGemm || nranks == 1;
  p.tma_store = ((mode & kModeTmaStore) || tma_auto) && p.cluster_m == 1 && own_output ? 1 : 0;
  return p;
}

}  // namespace dfccl::overlap
