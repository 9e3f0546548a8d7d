// ALL_TO_ALL: out[r] = in_r[me].  Staged: each rank pushes block p of its input
// to rank p, which places every source at its block of the output.  Direct:
// block p of the input is written into block me of p's output.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct AllToAllOp : SendBlockToEach, PlaceSources {
  static constexpr DirectShape kDirect = DirectShape::kPlaceBlock;
};
}  // namespace dfccl::gpu
