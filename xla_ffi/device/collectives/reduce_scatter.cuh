// REDUCE_SCATTER: out = reduce_r in_r[me].  Each rank pushes block p of its
// input to rank p; each rank reduces the received blocks with its own block.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct ReduceScatterOp : SendBlockToEach, ReduceSources {};
}  // namespace dfccl::gpu
