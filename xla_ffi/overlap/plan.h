// The launch plan of a fused GEMM (plan.cc; LaunchPlan in protocol.h): how a
// launch is cut into work (gemm_sched.cuh), decided on the host from the shape, the `mode` bits and the
// device alone -- so every rank of a group makes the same plan, and with it the
// same tile grid (the RS flags are one per tile of it).  Host code only; also
// exported by the extension module (`_dfccl_cuda.plan()`, tests and
// benchmarks, no GPU needed).
#pragma once

#include <cstdint>

#include "overlap/protocol.h"

namespace dfccl::overlap {

// kind: kAllGatherGemm or kGemmReduceScatter (protocol.h Kind); rows: rows of
// one row block (AG: x's rows; RS: M / nranks); n, k: the GEMM's columns and
// contraction; avail: the SMs left to the GEMM; cluster_ctas: CTAs of the 2x1
// variant resident at once.  Throws dfccl::Error for another kind, or when 2x1
// clusters are asked for and none fits.
LaunchPlan PlanLaunch(int32_t kind, int nranks, int rows, int n, int k, int avail, int cluster_ctas, int32_t mode);

}  // namespace dfccl::overlap
