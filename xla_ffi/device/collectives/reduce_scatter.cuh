// REDUCE_SCATTER: out = reduce_r in_r[me].  Staged: each rank pushes block p of
// its input to rank p and reduces the received blocks with its own.  Direct:
// each rank reads block me of every input in place.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct ReduceScatterOp : SendBlockToEach, ReduceSources {
  static constexpr DirectShape kDirect = DirectShape::kReduceBlock;
};
}  // namespace dfccl::gpu
