// ALL_REDUCE: out = reduce_r in_r.  One-shot push: every rank sends its whole
// input to every peer; each rank reduces all sources in one pass.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct AllReduceOp : SendWholeToAll, ReduceSources {};
}  // namespace dfccl::gpu
