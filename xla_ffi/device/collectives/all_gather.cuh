// ALL_GATHER: out[r] = in_r.  Staged: every rank pushes its input to every peer;
// each rank places every source (its own input included) at its block of the
// output.  Direct: every rank writes its input into block r of every output.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct AllGatherOp : SendWholeToAll, PlaceSources {
  static constexpr DirectShape kDirect = DirectShape::kPlaceWhole;
};
}  // namespace dfccl::gpu
