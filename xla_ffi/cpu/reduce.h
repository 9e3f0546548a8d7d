// Host kernels of the five flat-buffer collectives (see dfccl/collective.h).
//
// Each rank computes its own output by reading every peer's input directly
// (all ranks live in one process).  Only the reduction needs the element type;
// it is one template over (T, ReduceOp), dispatched through dfccl::DispatchDType.
// Reductions run in rank order 0..n-1; 16-bit floats accumulate in float and
// round once; int32 accumulates in int64 and wraps to 32 bits (exactly what
// two's complement int32 addition gives).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dfccl/check.h"
#include "dfccl/collective.h"
#include "dfccl/dtype.h"

namespace dfccl::cpu {

// Accumulator type and conversions per storage type.
template <typename T>
struct Acc {
  using type = T;
  static type Load(T v) { return v; }
  static T Store(type v) { return v; }
};
template <>
struct Acc<int32_t> {
  using type = int64_t;
  static type Load(int32_t v) { return v; }
  static int32_t Store(type v) { return static_cast<int32_t>(v); }  // modular (C++20)
};
template <>
struct Acc<half_t> {
  using type = float;
  static type Load(half_t v) { return v.to_float(); }
  static half_t Store(type v) { return half_t::from_float(v); }
};
template <>
struct Acc<bfloat16_t> {
  using type = float;
  static type Load(bfloat16_t v) { return v.to_float(); }
  static bfloat16_t Store(type v) { return bfloat16_t::from_float(v); }
};

// NaN-propagating max/min (XLA semantics); `a != a` is false for integers.
template <ReduceOp Op, typename A>
inline A Combine(A a, A b) {
  if constexpr (Op == ReduceOp::kSum) {
    return a + b;
  } else if constexpr (Op == ReduceOp::kMax) {
    return (a > b || a != a) ? a : b;
  } else {
    return (a < b || a != a) ? a : b;
  }
}

// out[i] = reduce_r ins[r][offset + i], i < count, in rank order.
template <typename T, ReduceOp Op>
void ReduceRanks(const std::vector<const void*>& ins, int64_t offset, int64_t count, void* out) {
  using A = typename Acc<T>::type;
  constexpr int64_t kChunk = 1024;  // accumulator stays in L1
  A acc[kChunk];
  const int n = static_cast<int>(ins.size());
  T* o = static_cast<T*>(out);
  for (int64_t base = 0; base < count; base += kChunk) {
    const int64_t m = std::min(kChunk, count - base);
    const T* p0 = static_cast<const T*>(ins[0]) + offset + base;
    for (int64_t i = 0; i < m; ++i) acc[i] = Acc<T>::Load(p0[i]);
    for (int r = 1; r < n; ++r) {
      const T* p = static_cast<const T*>(ins[r]) + offset + base;
      for (int64_t i = 0; i < m; ++i) acc[i] = Combine<Op>(acc[i], Acc<T>::Load(p[i]));
    }
    for (int64_t i = 0; i < m; ++i) o[base + i] = Acc<T>::Store(acc[i]);
  }
}

inline void Reduce(DType dtype, ReduceOp op, const std::vector<const void*>& ins, int64_t offset,
                   int64_t count, void* out) {
  DispatchDType(dtype, [&]<typename T>() {
    switch (op) {
      case ReduceOp::kSum: return ReduceRanks<T, ReduceOp::kSum>(ins, offset, count, out);
      case ReduceOp::kMax: return ReduceRanks<T, ReduceOp::kMax>(ins, offset, count, out);
      case ReduceOp::kMin: return ReduceRanks<T, ReduceOp::kMin>(ins, offset, count, out);
    }
    DFCCL_FAIL("dfccl: bad reduce op " << static_cast<int>(op));
  });
}

// Computes rank spec.rank's output from every rank's input (ins[r] = rank r's
// input buffer).  Throws dfccl::Error.
inline void ExecuteCollective(const CollectiveSpec& s, const std::vector<const void*>& ins, void* out) {
  const int64_t n = s.nranks, me = s.rank, E = s.elems_per_block, b = s.elem_bytes;
  DFCCL_CHECK(static_cast<int64_t>(ins.size()) == n, "dfccl: internal: wrong number of inputs");
  if (E == 0) return;  // zero-sized buffers may be null
  char* o = static_cast<char*>(out);
  auto in = [&](int64_t r) { return static_cast<const char*>(ins[r]); };
  switch (s.kind) {
    case OpKind::kAllReduce:
      Reduce(s.dtype, s.reduce, ins, 0, E, out);
      return;
    case OpKind::kReduceScatter:
      Reduce(s.dtype, s.reduce, ins, me * E, E, out);
      return;
    case OpKind::kAllGather:
      for (int64_t r = 0; r < n; ++r) std::memcpy(o + r * E * b, in(r), E * b);
      return;
    case OpKind::kAllToAll:
      for (int64_t r = 0; r < n; ++r) std::memcpy(o + r * E * b, in(r) + me * E * b, E * b);
      return;
    case OpKind::kPermute:
      if (s.recv_from < 0) {
        std::memset(o, 0, E * b);
      } else {
        DFCCL_CHECK(s.recv_from < n, "dfccl: collective '" << s.key << "': bad permutation source " << s.recv_from);
        std::memcpy(o, in(s.recv_from), E * b);
      }
      return;
  }
  DFCCL_FAIL("dfccl: bad op kind " << static_cast<int>(s.kind));
}

}  // namespace dfccl::cpu
