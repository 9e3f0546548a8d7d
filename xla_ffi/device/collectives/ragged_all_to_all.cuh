// RAGGED_ALL_TO_ALL (direct path only: DaemonPath::SiteDesc never gives it a staging
// pool; layout of the input: RaggedHeader in dfccl/ops.h).  The lanes split the
// sender's input bytes; a lane copies the part of every slice that lies in its
// range into the destination rank's output (which XLA initialised with the
// caller's values: the output is aliased).  Every rank handshakes with every
// peer, so a slice of size zero needs no special case.  A slice that would
// land outside its receiver's output (the receiver's out_rows, read from its
// header through the mailbox address) is not written: memory is never
// corrupted; the receiver's rows then keep their values.
#pragma once
#include "device/channel.cuh"
#include "dfccl/ops.h"
namespace dfccl::gpu {
struct RaggedAllToAllOp : SendWholeToAll {
  template <class T, class R>
  static DFCCL_DEV void Combine(const TaskDesc&, const char* const*, int64_t, int64_t) { __trap(); }
  template <class T, class R>
  static DFCCL_DEV void CombineUnit(const TaskDesc&, const uint2*, int64_t) { __trap(); }
  template <class T, class R>
  static DFCCL_DEV void DirectMove(const TaskDesc& d, const char* const* in, char* const* out, int64_t, int64_t a,
                                   int64_t len) {
    using H = RaggedHeader;
    const int n = d.nranks, me = d.rank;
    const int64_t* h = reinterpret_cast<const int64_t*>(in[me]);
    const int64_t row = __ldcg(reinterpret_cast<const long long*>(h + H::kRowBytes));
    const int64_t k = __ldcg(reinterpret_cast<const long long*>(h + H::kSlices));
    const int64_t in_rows = __ldcg(reinterpret_cast<const long long*>(h + H::kInRows));
    const int64_t base = H::Bytes(n, k);  // the operand's first byte in the input
    for (int64_t i = 0; i < n * k; ++i) {
      const int p = static_cast<int>(i / k);
      const int64_t off = __ldcg(reinterpret_cast<const long long*>(h + H::InOffset(i)));
      const int64_t size = __ldcg(reinterpret_cast<const long long*>(h + H::SendSize(i)));
      const int64_t dst_row = __ldcg(reinterpret_cast<const long long*>(h + H::OutOffset(i)));
      const int64_t peer_rows = __ldcg(reinterpret_cast<const long long*>(in[p]) + H::kOutRows);
      if (size <= 0 || off < 0 || off + size > in_rows || dst_row < 0 || dst_row + size > peer_rows) continue;
      const int64_t s0 = max(a, base + off * row), s1 = min(a + len, base + (off + size) * row);
      if (s0 >= s1) continue;
      char* dst[1] = {out[p] + dst_row * row + (s0 - base - off * row)};
      direct::Copy<char>(dst, 1, in[me] + s0, s1 - s0);
    }
  }
};
}  // namespace dfccl::gpu
