// REDUCE_SCATTER: out = reduce_r in_r[me].  Each rank pushes block p of its
// input to rank p; each rank reduces the received blocks with its own block.
#pragma once
#include "device/channel.cuh"
namespace dfccl::gpu {
struct ReduceScatterOp {
  static DFCCL_DEV bool SendsTo(const TaskDesc&, int) { return true; }
  static DFCCL_DEV int64_t SendOffset(const TaskDesc& d, int p) { return p * d.msg_bytes; }
  static DFCCL_DEV bool RecvsFrom(const TaskDesc&, int) { return true; }
  static DFCCL_DEV int64_t SelfOffset(const TaskDesc& d) { return d.rank * d.msg_bytes; }
  template <class T, class R>
  static DFCCL_DEV void Combine(const TaskDesc& d, const char* const* src, int64_t off, int64_t len) {
    ReduceAll<T, R>(d, src, off, len);
  }
  template <class T, class R>
  static DFCCL_DEV void CombineUnit(const TaskDesc& d, const uint2* v, int64_t off) { ReduceAllUnit<T, R>(d, v, off); }
};
}  // namespace dfccl::gpu
