// Device building blocks of every collective: memory-ordering helpers, the
// block-wide copy and reduction over 16-byte vectors, the accumulator types.
// Data loads go through ld.global.cg (L2, never L1): the daemon is persistent,
// so an L1 line could outlive a buffer's reuse by XLA or a peer's next write.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device/task.h"
#include "dfccl/reduce.h"

#define DFCCL_DEV __device__ __forceinline__

namespace dfccl::gpu {

DFCCL_DEV uint64_t LdAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV void StReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
DFCCL_DEV uint32_t LdAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV void StReleaseSys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
DFCCL_DEV uint64_t LdAcquireGpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV uint32_t LdAcquireGpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV void StReleaseGpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
DFCCL_DEV void StReleaseGpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// System-scope atomics with acquire/release semantics (lighter than a separate
// fence.sc.sys around a relaxed atomic): the match table's lock and counters.
DFCCL_DEV uint32_t CasAcquireSys(uint32_t* p, uint32_t cmp, uint32_t val) {
  uint32_t old;
  asm volatile("atom.acquire.sys.global.cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(cmp), "r"(val) : "memory");
  return old;
}
DFCCL_DEV uint64_t CasAcquireSys(uint64_t* p, uint64_t cmp, uint64_t val) {
  uint64_t old;
  asm volatile("atom.acquire.sys.global.cas.b64 %0, [%1], %2, %3;" : "=l"(old) : "l"(p), "l"(cmp), "l"(val) : "memory");
  return old;
}
DFCCL_DEV uint32_t CasAcquireGpu(uint32_t* p, uint32_t cmp, uint32_t val) {
  uint32_t old;
  asm volatile("atom.acquire.gpu.global.cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(cmp), "r"(val) : "memory");
  return old;
}
DFCCL_DEV uint32_t AddAcqRelSys(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.sys.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
template <class T>
DFCCL_DEV T LdVol(const volatile T* p) { return *p; }
template <class T, class V>
DFCCL_DEV void StVol(volatile T* p, V v) { *p = static_cast<T>(v); }
DFCCL_DEV void StVolVec(void* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
DFCCL_DEV uint4 LdVolVec(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
// Launched with programmatic stream serialization: waits until the stream's
// previous kernel is complete and its memory visible (at once without it).
DFCCL_DEV void GridDependencyWait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Release/acquire fence at system scope (MEMBAR.ALL.SYS: lighter than
// __threadfence_system's fence.sc.sys, and no L1 invalidation).  Cumulative:
// after a bar.sync it also orders the other participating threads' earlier
// accesses; with a later strong store of this thread it forms a release pattern.
DFCCL_DEV void FenceAcqRelSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// Brings the 128-byte line at p into L1 (no wait, no register).
DFCCL_DEV void PrefetchL1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
DFCCL_DEV uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Accumulators, reduce functors (SumOp, MaxOp, MinOp), Begin and
// DispatchReduce: the one reduction library, dfccl/reduce.h (NCCL's semantics
// on the GPU: folds start from rank 0's value, kDeviceStart).

// The CUDA 16-bit float types for dfccl::DispatchDType (dfccl/dtype.h).
struct CudaTypes {
  using f16 = __half;
  using bf16 = __nv_bfloat16;
};

// d[0:n16) = s[0:n16) in 16-byte vectors by kStride threads (`tid`: this one's
// index among them), four loads in flight per thread.
template <int kStride>
DFCCL_DEV void CopyVec16(uint4* d, const uint4* s, int64_t n16, int tid) {
  int64_t i = tid;
  for (; i + 3 * kStride < n16; i += 4 * kStride) {
    uint4 a = __ldcg(s + i), b = __ldcg(s + i + kStride), c = __ldcg(s + i + 2 * kStride), e = __ldcg(s + i + 3 * kStride);
    d[i] = a; d[i + kStride] = b; d[i + 2 * kStride] = c; d[i + 3 * kStride] = e;
  }
  for (; i < n16; i += kStride) d[i] = __ldcg(s + i);
}

// dst[0:n) = src[0:n), by the whole block.  vec: both 16-byte aligned and n % 16 == 0.
DFCCL_DEV void BlockCopy(char* dst, const char* src, int64_t n, bool vec, int elem_bytes) {
  if (vec) {
    CopyVec16<kThreads>(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), n >> 4, threadIdx.x);
    return;
  }
  switch (elem_bytes) {
    case 8: for (int64_t i = threadIdx.x; i < n / 8; i += kThreads)
              reinterpret_cast<uint64_t*>(dst)[i] = __ldcg(reinterpret_cast<const unsigned long long*>(src) + i);
            break;
    case 4: for (int64_t i = threadIdx.x; i < n / 4; i += kThreads)
              reinterpret_cast<uint32_t*>(dst)[i] = __ldcg(reinterpret_cast<const unsigned int*>(src) + i);
            break;
    default: for (int64_t i = threadIdx.x; i < n / 2; i += kThreads)
              reinterpret_cast<uint16_t*>(dst)[i] = __ldcg(reinterpret_cast<const unsigned short*>(src) + i);
            break;
  }
}

DFCCL_DEV void BlockZero(char* dst, int64_t n) {
  for (int64_t i = threadIdx.x; i < n / 2; i += kThreads) reinterpret_cast<uint16_t*>(dst)[i] = 0;
}

// dst = R-reduction of srcs[0..nsrc) (each n bytes), by the whole block.
template <class T, class R>
DFCCL_DEV void BlockReduce(char* dst, const char* const* srcs, int nsrc, int64_t n, bool vec) {
  using A = typename Acc<T>::type;
  const R op;
  if (vec) {
    constexpr int K = 16 / sizeof(T);
    const int64_t n16 = n >> 4;
    for (int64_t i = threadIdx.x; i < n16; i += kThreads) {
      uint4 v = __ldcg(reinterpret_cast<const uint4*>(srcs[0]) + i);
      A acc[K];
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = Begin<R, kDeviceStart>(Acc<T>::Load(reinterpret_cast<const T*>(&v)[k]));
      for (int s = 1; s < nsrc; ++s) {
        uint4 w = __ldcg(reinterpret_cast<const uint4*>(srcs[s]) + i);
#pragma unroll
        for (int k = 0; k < K; ++k) acc[k] = op(acc[k], Acc<T>::Load(reinterpret_cast<const T*>(&w)[k]));
      }
#pragma unroll
      for (int k = 0; k < K; ++k) reinterpret_cast<T*>(&v)[k] = Acc<T>::Store(acc[k]);
      reinterpret_cast<uint4*>(dst)[i] = v;
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < n / static_cast<int64_t>(sizeof(T)); i += kThreads) {
    A acc = Begin<R, kDeviceStart>(Acc<T>::Load(LdVol(reinterpret_cast<const T*>(srcs[0]) + i)));
    for (int s = 1; s < nsrc; ++s) acc = op(acc, Acc<T>::Load(LdVol(reinterpret_cast<const T*>(srcs[s]) + i)));
    reinterpret_cast<T*>(dst)[i] = Acc<T>::Store(acc);
  }
}

}  // namespace dfccl::gpu
