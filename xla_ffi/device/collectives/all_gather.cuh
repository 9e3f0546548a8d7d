// ALL_GATHER: out[r] = in_r.  Every rank pushes its input to every peer; each
// rank places every source (its own input included) at its block of the output.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct AllGatherOp {
  static DFCCL_DEV bool SendsTo(const TaskDesc&, int) { return true; }
  static DFCCL_DEV int64_t SendOffset(const TaskDesc&, int) { return 0; }
  static DFCCL_DEV bool RecvsFrom(const TaskDesc&, int) { return true; }
  static DFCCL_DEV int64_t SelfOffset(const TaskDesc&) { return 0; }
  template <class T, class R>
  static DFCCL_DEV void Combine(const TaskDesc& d, const char* const* src, int64_t off, int64_t len) {
    PlaceAll(d, src, off, len);
  }
  template <class T, class R>
  static DFCCL_DEV void CombineUnit(const TaskDesc& d, const uint2* v, int64_t off) { PlaceAllUnit(d, v, off); }
};
}  // namespace dfccl::gpu
