// The copy-engine path's done wait: one thread on XLA's stream polls the
// instance's completion word in host memory (ld.acquire.sys, GEQ on the
// generation as cuStreamWaitValue32 does) with short sleeps.
#include "device/daemon.h"
#include "device/primitives.cuh"

namespace dfccl::gpu {
namespace {

__global__ void StreamWaitKernel(const uint32_t* addr, uint32_t value) {
  while (static_cast<int32_t>(LdAcquireSys(addr) - value) < 0) __nanosleep(200);
}

}  // namespace

cudaError_t PreloadStreamWait() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, StreamWaitKernel);
}

cudaError_t LaunchStreamWait(cudaStream_t stream, const uint32_t* addr, uint32_t value) {
  StreamWaitKernel<<<1, 1, 0, stream>>>(addr, value);
  return cudaGetLastError();
}

}  // namespace dfccl::gpu
