// The launch plan of a fused GEMM (plan.cc): how a launch is cut into work
// (gemm_sched.cuh), decided on the host from the shape, the `mode` bits and the
// device alone -- so every rank of a group makes the same plan, and with it the
// same tile grid (the RS flags are one per tile of it).  Host code only; also
// exported by the extension module (`_dfccl_overlap.plan()`, tests and
// benchmarks, no GPU needed).
#pragma once

#include <cstdint>

#include "overlap/protocol.h"

namespace dfccl::overlap {

// tile_n: the tile width (one of kTileNs); cluster_m: 1x1 or 2x1 clusters;
// tiles: whole tiles of every row block; units: work units (a split last
// wave's sk_tiles tiles as sk_units chunks); grid: CTAs; pdl: programmatic
// dependent launch.  These are GemmLaunch's fields of the same names.
struct LaunchPlan {
  int tile_n = 0, cluster_m = 1, tiles = 0, units = 0, sk_units = 0, sk_tiles = 0, grid = 0, pdl = 0;
};

// rows: rows of one row block (AG: x's rows; RS: M / nranks); n, k: the GEMM's
// columns and contraction; avail: the SMs left to the GEMM; cluster_ctas: CTAs
// of the 2x1 variant resident at once.  Throws dfccl::Error when 2x1 clusters
// are asked for and none fits.
LaunchPlan PlanLaunch(int nranks, int rows, int n, int k, int avail, int cluster_ctas, int32_t mode);

}  // namespace dfccl::overlap
