// The one reduction library: accumulator types, the reduce functors and how a
// fold over the ranks starts, for host code (the CPU backend) and device code
// (every reduction loop of the daemon kernel and the copy-engine combine).
//
// Semantics, chosen to equal jax.lax on the same backend:
//   * 16-bit floats accumulate in float and are rounded once at the end; every
//     other type accumulates in itself; int32 sums wrap (two's complement).
//   * max/min ignore a NaN: combine(acc, v) = v if v > acc (v < acc) or acc is
//     NaN, else acc.  -0.0 and +0.0 compare equal, so the first one folded in wins.
//   * Where the fold starts (Start):
//       kIdentity  (CPU backend, as XLA:CPU's all-reduce): from the identity 0,
//                  -inf/lowest (max) or +inf/highest (min).  So psum of -0.0
//                  everywhere is +0.0, and pmax of NaN everywhere is -inf.
//       kFirst     (GPU backend, as NCCL: fmaxf/__hmax and a ring's plain sums):
//                  from rank 0's value.  So psum of -0.0 everywhere is -0.0 and
//                  pmax of NaN everywhere is NaN.
//     Both agree on everything else (any finite or infinite value wins over a NaN).
//   * Ranks are folded in rank order 0..n-1 (sums of floats are therefore
//     deterministic, but may round differently from jax.lax's order).
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "dfccl/dtype.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace dfccl {

// ---- accumulators ------------------------------------------------------------
template <class T>
struct Acc {
  using type = T;
  static DFCCL_HD T Load(T v) { return v; }
  static DFCCL_HD T Store(T a) { return a; }
};
template <>
struct Acc<half_t> {
  using type = float;
  static DFCCL_HD float Load(half_t v) { return v.to_float(); }
  static DFCCL_HD half_t Store(float a) { return half_t::from_float(a); }
};
template <>
struct Acc<bfloat16_t> {
  using type = float;
  static DFCCL_HD float Load(bfloat16_t v) { return v.to_float(); }
  static DFCCL_HD bfloat16_t Store(float a) { return bfloat16_t::from_float(a); }
};
#if defined(__CUDACC__)
template <>
struct Acc<__half> {
  using type = float;
  static __device__ __forceinline__ float Load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half Store(float a) { return __float2half_rn(a); }
};
template <>
struct Acc<__nv_bfloat16> {
  using type = float;
  static __device__ __forceinline__ float Load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 Store(float a) { return __float2bfloat16_rn(a); }
};
#endif

// ---- reduce functors: op(acc, v), and the identity ---------------------------
template <class A>
DFCCL_HD A Lowest() {
  if constexpr (std::numeric_limits<A>::has_infinity) return -std::numeric_limits<A>::infinity();
  else return std::numeric_limits<A>::lowest();
}
template <class A>
DFCCL_HD A Highest() {
  if constexpr (std::numeric_limits<A>::has_infinity) return std::numeric_limits<A>::infinity();
  else return std::numeric_limits<A>::max();
}

struct SumOp {
  template <class A>
  DFCCL_HD A operator()(A acc, A v) const {
    if constexpr (std::is_integral_v<A>) {  // wraps, without signed-overflow UB
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(acc) + static_cast<U>(v));
    } else {
      return acc + v;
    }
  }
  template <class A>
  static DFCCL_HD A Identity() { return A(0); }
};
struct MaxOp {
  template <class A>
  DFCCL_HD A operator()(A acc, A v) const { return (v > acc || acc != acc) ? v : acc; }
  template <class A>
  static DFCCL_HD A Identity() { return Lowest<A>(); }
};
struct MinOp {
  template <class A>
  DFCCL_HD A operator()(A acc, A v) const { return (v < acc || acc != acc) ? v : acc; }
  template <class A>
  static DFCCL_HD A Identity() { return Highest<A>(); }
};

enum class Start { kIdentity, kFirst };
// Where each backend's folds start (see the top of this file).
inline constexpr Start kHostStart = Start::kIdentity;
inline constexpr Start kDeviceStart = Start::kFirst;

// The accumulator after folding in the first rank's value.
template <class R, Start S, class A>
DFCCL_HD A Begin(A first) {
  if constexpr (S == Start::kFirst) return first;
  else return R()(R::template Identity<A>(), first);
}

// The one reduce-op dispatch (host and device): f.template operator()<R>() with
// R the functor of `op` (the table in dfccl/ops.h).
template <class F>
DFCCL_HD decltype(auto) DispatchReduce(ReduceOp op, F&& f) {
  switch (op) {
#define DFCCL_X(E, name, id, Fn) \
  case ReduceOp::E:              \
    return f.template operator()<Fn>();
    DFCCL_REDUCE_TABLE(DFCCL_X)
#undef DFCCL_X
  }
  return f.template operator()<SumOp>();  // unreachable: ops are validated when decoded
}

}  // namespace dfccl
