// Stream memory operations of the CUDA driver, reached through
// cudaGetDriverEntryPointByVersion (no libcuda at link time).  On the H200
// machines the legacy cuStreamWriteValue32/cuStreamWaitValue32 entry points
// return CUDA_ERROR_NOT_SUPPORTED (801); the _v2 ones (CUDA >= 11.7 ABI) work.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dfccl::gpu {

struct StreamOps {
  // *addr = value once prior work on `stream` is complete (with a memory barrier).
  static void Write32(cudaStream_t stream, void* addr, uint32_t value);
  // `stream` waits until (int32_t)(*addr - value) >= 0.
  static void WaitGeq32(cudaStream_t stream, const void* addr, uint32_t value);
};

}  // namespace dfccl::gpu
