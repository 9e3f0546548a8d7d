// The element-wise combine of the copy-engine path: out = R(out, in) over
// `bytes`, launched on a side stream once the copy engine has brought a peer's
// chunk into `out` (runtime/copy_engine.cc).  One template, dispatched once
// per launch on (dtype, reduce op).  Grid-stride over 16-byte vectors with
// kUnroll vectors of each operand in flight per thread (a chunk must be
// combined faster than the next one crosses NVLink), then the tail element by
// element.
#include "device/daemon.h"
#include "device/primitives.cuh"
#include "dfccl/dtype.h"

namespace dfccl::gpu {
namespace {

constexpr int kUnroll = 8;

template <class T, class R>
__global__ void __launch_bounds__(kThreads) ReduceIntoKernel(char* out, const char* in, int64_t bytes, bool vec) {
  using A = typename Acc<T>::type;
  constexpr int K = 16 / sizeof(T);
  const R op;
  const int64_t n16 = vec ? bytes / 16 : 0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads * kUnroll;
  uint4* o = reinterpret_cast<uint4*>(out);
  const uint4* x = reinterpret_cast<const uint4*>(in);
  for (int64_t i0 = static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x; i0 < n16; i0 += step) {
    uint4 a[kUnroll], b[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + static_cast<int64_t>(u) * kThreads;
      if (i < n16) { a[u] = __ldcg(o + i); b[u] = __ldcg(x + i); }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + static_cast<int64_t>(u) * kThreads;
      if (i >= n16) continue;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const A r = op(Acc<T>::Load(reinterpret_cast<const T*>(&a[u])[k]), Acc<T>::Load(reinterpret_cast<const T*>(&b[u])[k]));
        reinterpret_cast<T*>(&a[u])[k] = Acc<T>::Store(r);
      }
      o[i] = a[u];
    }
  }
  const int64_t e0 = n16 * 16 / static_cast<int64_t>(sizeof(T)), ne = bytes / static_cast<int64_t>(sizeof(T));
  T* ot = reinterpret_cast<T*>(out);
  const T* xt = reinterpret_cast<const T*>(in);
  for (int64_t i = e0 + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < ne;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    ot[i] = Acc<T>::Store(op(Acc<T>::Load(ot[i]), Acc<T>::Load(xt[i])));
}

// The kernel instance for (dtype, reduce op): the one dispatch of this file.
using ReduceIntoFn = void (*)(char*, const char*, int64_t, bool);
ReduceIntoFn KernelFor(DType dtype, ReduceOp reduce) {
  return DispatchDType<CudaTypes>(dtype, [&]<class T>() {
    return DispatchReduce(reduce, [&]<class R>() -> ReduceIntoFn { return ReduceIntoKernel<T, R>; });
  });
}

}  // namespace

// With lazy module loading, the first launch of a kernel loads it, and loading
// synchronizes the context: it would wait for a done-wait kernel spinning on
// XLA's stream for this very combine -- a deadlock.  Loaded up front instead.
cudaError_t PreloadReduceKernels() {
  for (DType t : {DType::kS32, DType::kF16, DType::kF32, DType::kF64, DType::kBF16}) {
    for (ReduceOp r : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      cudaFuncAttributes a;
      if (const cudaError_t e = cudaFuncGetAttributes(&a, KernelFor(t, r)); e != cudaSuccess) return e;
    }
  }
  return cudaSuccess;
}

cudaError_t LaunchReduceInto(cudaStream_t stream, DType dtype, ReduceOp reduce, char* out, const char* in,
                             int64_t bytes, int max_blocks) {
  if (bytes <= 0) return cudaSuccess;
  const bool vec = reinterpret_cast<uintptr_t>(out) % 16 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0;
  // One block per kThreads x kUnroll vectors (64 KiB), at most max_blocks.
  int64_t blocks = (bytes + kThreads * kUnroll * 16 - 1) / (kThreads * kUnroll * 16);
  if (blocks > max_blocks) blocks = max_blocks;
  if (blocks < 1) blocks = 1;
  KernelFor(dtype, reduce)<<<blocks, kThreads, 0, stream>>>(out, in, bytes, vec);
  return cudaGetLastError();
}

}  // namespace dfccl::gpu
