// ALL_TO_ALL: out[r] = in_r[me].  Each rank pushes block p of its input to
// rank p; each rank places every source at its block of the output.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct AllToAllOp : SendBlockToEach, PlaceSources {};
}  // namespace dfccl::gpu
