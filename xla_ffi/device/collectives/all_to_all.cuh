// ALL_TO_ALL: out[r] = in_r[me].  Staged: each rank pushes block p of its input
// to rank p, which places every source at its block of the output.  Direct:
// block p of the input is written into block me of p's output.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct AllToAllOp : SendBlockToEach, PlaceSources {
  template <class T, class R>
  static DFCCL_DEV void DirectMove(const TaskDesc& d, const char* const* in, char* const* out, int64_t unit, int64_t a,
                                   int64_t len) {
    const int n = d.nranks, me = d.rank;
    for (int i = 1; i <= n; ++i) {  // peers first (from me + 1, spreading the links' load), own block last
      const int p = (me + i) % n;
      char* dst[1] = {out[p] + me * d.msg_bytes + a};
      direct::Copy<T>(dst, 1, in[me] + p * d.msg_bytes + a, len);
    }
  }
};
}  // namespace dfccl::gpu
