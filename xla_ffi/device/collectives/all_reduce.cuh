// ALL_REDUCE: out = reduce_r in_r.  Staged (LL): one-shot push, every rank sends
// its whole input to every peer and reduces all sources in one pass.  Direct:
// rank r reduces segment r of every input and writes it into every output
// (reduce-scatter and all-gather in one pass, each byte crosses a link once).
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct AllReduceOp : SendWholeToAll, ReduceSources {
  // Direct: this rank's segment (DirectUnitBytes: one per rank), clipped to the message.
  static DFCCL_DEV int64_t DirectShare(const TaskDesc& d, int64_t unit) {
    return max(int64_t{0}, min(unit, d.msg_bytes - d.rank * unit));
  }
  template <class T, class R>
  static DFCCL_DEV void DirectMove(const TaskDesc& d, const char* const* in, char* const* out, int64_t unit, int64_t a,
                                   int64_t len) {
    const char* src[kMaxRanks];
    char* dst[kMaxRanks];
    for (int r = 0; r < d.nranks; ++r) { src[r] = in[r] + d.rank * unit + a; dst[r] = out[r] + d.rank * unit + a; }
    direct::Reduce<T, R>(dst, d.nranks, src, d.nranks, len);
  }
};
}  // namespace dfccl::gpu
