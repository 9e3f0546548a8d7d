// REDUCE_SCATTER: out = reduce_r in_r[me].  Staged: each rank pushes block p of
// its input to rank p and reduces the received blocks with its own.  Direct:
// each rank reads block me of every input in place.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct ReduceScatterOp : SendBlockToEach, ReduceSources {
  template <class T, class R>
  static DFCCL_DEV void DirectMove(const TaskDesc& d, const char* const* in, char* const* out, int64_t unit, int64_t a,
                                   int64_t len) {
    const char* src[kMaxRanks];
    char* dst[1] = {out[d.rank] + a};
    for (int r = 0; r < d.nranks; ++r) src[r] = in[r] + d.rank * d.msg_bytes + a;
    direct::Reduce<T, R>(dst, 1, src, d.nranks, len);
  }
};
}  // namespace dfccl::gpu
