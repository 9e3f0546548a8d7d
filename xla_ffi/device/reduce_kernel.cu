// The element-wise combine of the copy-engine path: out = R(out, in) over
// `bytes`, launched on a side stream once the copy engine has brought a peer's
// chunk into `out` (runtime/copy_engine.cc).  One template, dispatched once
// per launch on (dtype, reduce op); the block loop is primitives.cuh's BlockReduce.
#include "device/daemon.h"
#include "device/primitives.cuh"
#include "dfccl/dtype.h"

namespace dfccl::gpu {
namespace {

template <class T, class R>
__global__ void __launch_bounds__(kThreads) ReduceIntoKernel(char* out, const char* in, int64_t bytes, int64_t slice,
                                                             bool vec) {
  const int64_t off = static_cast<int64_t>(blockIdx.x) * slice;
  if (off >= bytes) return;
  const int64_t len = bytes - off < slice ? bytes - off : slice;
  const char* srcs[2] = {out + off, in + off};
  BlockReduce<T, R>(out + off, srcs, 2, len, vec);
}

// The kernel instance for (dtype, reduce op): the one dispatch of this file.
using ReduceIntoFn = void (*)(char*, const char*, int64_t, int64_t, bool);
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
  const bool vec = reinterpret_cast<uintptr_t>(out) % 16 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
                   bytes % 16 == 0;
  const int64_t esize = DTypeBytes(dtype);
  // Slices are whole 16-byte vectors (vec) or whole elements, at least 64 KiB a block.
  const int64_t unit = vec ? 16 : esize;
  int64_t blocks = (bytes + (64 << 10) - 1) / (64 << 10);
  if (blocks > max_blocks) blocks = max_blocks;
  if (blocks < 1) blocks = 1;
  const int64_t slice = ((bytes + blocks - 1) / blocks + unit - 1) / unit * unit;
  blocks = (bytes + slice - 1) / slice;
  KernelFor(dtype, reduce)<<<blocks, kThreads, 0, stream>>>(out, in, bytes, slice, vec);
  return cudaGetLastError();
}

}  // namespace dfccl::gpu
