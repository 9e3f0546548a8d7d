// ALL_REDUCE: out = reduce_r in_r.  Staged (LL): one-shot push, every rank sends
// its whole input to every peer and reduces all sources in one pass.  Direct:
// rank r reduces segment r of every input and writes it into every output
// (reduce-scatter and all-gather in one pass, each byte crosses a link once).
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct AllReduceOp : SendWholeToAll, ReduceSources {
  static constexpr DirectShape kDirect = DirectShape::kReduceSegment;
};
}  // namespace dfccl::gpu
