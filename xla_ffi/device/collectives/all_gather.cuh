// ALL_GATHER: out[r] = in_r.  Every rank pushes its input to every peer; each
// rank places every source (its own input included) at its block of the output.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct AllGatherOp : SendWholeToAll, PlaceSources {};
}  // namespace dfccl::gpu
