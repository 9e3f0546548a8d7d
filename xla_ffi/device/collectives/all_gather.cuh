// ALL_GATHER: out[r] = in_r.  Staged: every rank pushes its input to every peer;
// each rank places every source (its own input included) at its block of the
// output.  Direct: every rank writes its input into block r of every output.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct AllGatherOp : SendWholeToAll, PlaceSources {
  template <class T, class R>
  static DFCCL_DEV void DirectMove(const TaskDesc& d, const char* const* in, char* const* out, int64_t unit, int64_t a,
                                   int64_t len) {
    char* dst[kMaxRanks];
    for (int r = 0; r < d.nranks; ++r) dst[r] = out[r] + d.rank * d.msg_bytes + a;
    direct::Copy<T>(dst, d.nranks, in[d.rank] + a, len);
  }
};
}  // namespace dfccl::gpu
