// PPERMUTE: out = in_{recv_from}, or zeros when no rank sends to me.  A rank
// pushes its input to send_to only (staged, or directly into send_to's
// output); a self-pair copies locally.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct PermuteOp {
  template <class T, class R>
  static DFCCL_DEV void DirectMove(const TaskDesc& d, const char* const* in, char* const* out, int64_t unit, int64_t a,
                                   int64_t len) {
    char* dst[1];
    if (d.send_to >= 0) { dst[0] = out[d.send_to] + a; direct::Copy<T>(dst, 1, in[d.rank] + a, len); }
    if (d.recv_from < 0) { dst[0] = out[d.rank] + a; direct::Copy<T>(dst, 1, nullptr, len); }
  }
  static DFCCL_DEV bool SendsTo(const TaskDesc& d, int p) { return p == d.send_to; }
  static DFCCL_DEV int64_t SendOffset(const TaskDesc&, int) { return 0; }
  static DFCCL_DEV bool RecvsFrom(const TaskDesc& d, int r) { return r == d.recv_from; }
  static DFCCL_DEV int64_t SelfOffset(const TaskDesc&) { return 0; }
  template <class T, class R>
  static DFCCL_DEV void Combine(const TaskDesc& d, const char* const* src, int64_t off, int64_t len) {
    if (d.recv_from < 0) BlockZero(d.out + off, len);
    else BlockCopy(d.out + off, src[d.recv_from], len, d.vec, d.elem_bytes);
  }
  template <class T, class R>
  static DFCCL_DEV void CombineUnit(const TaskDesc& d, const uint2* v, int64_t off) {
    *reinterpret_cast<uint2*>(d.out + off) = d.recv_from < 0 ? make_uint2(0, 0) : v[d.recv_from];
  }
};
}  // namespace dfccl::gpu
