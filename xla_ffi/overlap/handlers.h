// XLA FFI handlers of the fused overlap ops (CUDA; module _dfccl_overlap).
//
// dfccl_overlap_ag(x[m,K], w[K,n]) -> (out[P*m,n], xg[P*m,K] or [0,K])
//     all_gather(x, rows) @ w; xg (when not empty) receives all_gather(x).
// dfccl_overlap_rs(x[M,k], w[k,N]) -> out[M/P,N]
//     psum_scatter(x @ w, rows).
// Attributes: key (op identity: kind, dtype, shapes), devices (i64, the
// device ordinals of every group, a row of group_size per group, in rank
// order), group_size, timeout_ns (bound of every cross-rank wait; from
// jax_dfccl.config.overlap_wait_timeout_s), mode (protocol.h enum Mode: copy
// engine for AG rows, one fence per CTA in RS, copy engine for RS partials).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace dfccl::overlap {

XLA_FFI_DECLARE_HANDLER_SYMBOL(OverlapAgCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OverlapRsCuda);

// How a fused GEMM launch is cut into work (gemm_sched.cuh), decided on the
// host from the shape, the `mode` bits and the device alone -- so every rank
// of a group makes the same plan: the tile width (kTileNs), the cluster shape,
// the tiles of the launch (every row block), its work units (a split last
// wave's sk_tiles tiles as sk_units chunks), the grid and the programmatic
// launch.  rows: rows of one row block (AG: x's rows; RS: M / nranks); avail:
// the SMs left to the GEMM; cluster_ctas: CTAs of the 2x1 variant resident at
// once.  Exported for tests and benchmarks (no GPU needed).
struct LaunchPlan {
  int tile_n = 0, cluster_m = 1, tiles = 0, units = 0, sk_units = 0, sk_tiles = 0, grid = 0, pdl = 0;
};
LaunchPlan PlanLaunch(int nranks, int rows, int n, int k, int avail, int cluster_ctas, int32_t mode);

// Errors recorded by timed-out waits so far (one line per channel).
std::vector<std::string> Errors();

// Diagnostics: no_comm (fused GEMM without waits or remote stores; results
// invalid) and profile (CUDA-event time of every fused GEMM kernel and side-
// stream transfer, plus the device timeline of every launch summarized per
// launch; collected and cleared by ProfileResults: (op key|gemm[_nocomm] /
// |push / |copy / |host / |tl_<what>, ms); tl_* are described at Summarize in
// handlers.cc).
void SetDiag(bool no_comm, bool profile);
std::vector<std::pair<std::string, float>> ProfileResults();

}  // namespace dfccl::overlap
