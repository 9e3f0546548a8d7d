// ALL_REDUCE: out = reduce_r in_r.  One-shot push: every rank sends its whole
// input to every peer; each rank reduces all sources in one pass.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct AllReduceOp {
  static DFCCL_DEV bool SendsTo(const TaskDesc&, int) { return true; }
  static DFCCL_DEV int64_t SendOffset(const TaskDesc&, int) { return 0; }
  static DFCCL_DEV bool RecvsFrom(const TaskDesc&, int) { return true; }
  static DFCCL_DEV int64_t SelfOffset(const TaskDesc&) { return 0; }
  template <class T, class R>
  static DFCCL_DEV void Combine(const TaskDesc& d, const char* const* src, int64_t off, int64_t len) {
    ReduceAll<T, R>(d, src, off, len);
  }
  template <class T, class R>
  static DFCCL_DEV void CombineUnit(const TaskDesc& d, const uint2* v, int64_t off) { ReduceAllUnit<T, R>(d, v, off); }
};
}  // namespace dfccl::gpu
