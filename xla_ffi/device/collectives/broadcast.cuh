// BROADCAST: out = in_source (TaskDesc::recv_from is the source on every rank).
// Staged: the source pushes its input to every peer, every rank copies the
// source's (its own, at the source) into its output.  Direct: the source writes
// its input into every rank's output.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct BroadcastOp {
  static DFCCL_DEV bool SendsTo(const TaskDesc& d, int) { return d.rank == d.recv_from; }
  static DFCCL_DEV int64_t SendOffset(const TaskDesc&, int) { return 0; }
  static DFCCL_DEV bool RecvsFrom(const TaskDesc& d, int r) { return r == d.recv_from; }
  static DFCCL_DEV int64_t SelfOffset(const TaskDesc&) { return 0; }
  template <class T, class R>
  static DFCCL_DEV void Combine(const TaskDesc& d, const char* const* src, int64_t off, int64_t len) {
    BlockCopy(d.out + off, src[d.recv_from], len, d.vec, d.elem_bytes);
  }
  template <class T, class R>
  static DFCCL_DEV void CombineUnit(const TaskDesc& d, const uint2* v, int64_t off) {
    *reinterpret_cast<uint2*>(d.out + off) = v[d.recv_from];
  }
  template <class T, class R>
  static DFCCL_DEV void DirectMove(const TaskDesc& d, const char* const* in, char* const* out, int64_t, int64_t a,
                                   int64_t len) {
    if (d.rank != d.recv_from) return;
    char* dst[kMaxRanks];
    for (int r = 0; r < d.nranks; ++r) dst[r] = out[r] + a;
    direct::Copy<T>(dst, d.nranks, in[d.rank] + a, len);
  }
};
}  // namespace dfccl::gpu
