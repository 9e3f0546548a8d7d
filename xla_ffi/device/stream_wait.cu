// The kernel form of the done wait: one thread on XLA's stream polls the task's
// completion word (ld.acquire.sys, GEQ on the generation as cuStreamWaitValue32
// does) with short sleeps.  Used for messages of at least
// Config::wait_kernel_bytes, and for every task while tracing: then it records
// when XLA's stream reached the wait and when it saw the task done.
#include "device/daemon.h"
#include "device/primitives.cuh"

namespace dfccl::gpu {
namespace {

__global__ void StreamWaitKernel(const uint32_t* addr, uint32_t value, TraceRec* rec, TraceRec proto) {
  if (rec) { proto.t_ns = GlobalTimer(); proto.event = kEvStreamWait; rec[0] = proto; }
  while (static_cast<int32_t>(LdAcquireSys(addr) - value) < 0) __nanosleep(200);
  if (rec) { proto.t_ns = GlobalTimer(); proto.event = kEvStreamWoke; rec[1] = proto; }
}

}  // namespace

cudaError_t PreloadStreamWait() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, StreamWaitKernel);
}

cudaError_t LaunchStreamWait(cudaStream_t stream, const uint32_t* addr, uint32_t value, TraceRec* rec,
                             const TraceRec& proto) {
  StreamWaitKernel<<<1, 1, 0, stream>>>(addr, value, rec, proto);
  return cudaGetLastError();
}

}  // namespace dfccl::gpu
