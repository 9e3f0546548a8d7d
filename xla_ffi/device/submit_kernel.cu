// The kernels a collective puts on XLA's stream (protocol: device/task.h,
// "submit" and "done"): a one-thread submit kernel, which is the task's ready
// signal, and a one-thread done wait (the inline submit kernel of small blocking
// collectives is in device/daemon_kernel.cu, beside the lane functions).  Their
// parameters are all a call needs, so XLA can capture them into a command buffer
// and replay them without calling the handlers.  Every wait is bounded (timeout_ns); past it the kernel
// traps: a wait that long means the daemon is gone, and a hang is the alternative.
#include "device/daemon.h"
#include "device/submit.cuh"

namespace dfccl::gpu {
namespace {

__global__ void SubmitKernel(SubmitParams p) {
  const uint64_t t_enter = p.trace ? GlobalTimer() : 0;
  TaskDesc d;
  SubmitBegin(p, d);
  const uint64_t t_matched = p.trace ? GlobalTimer() : 0;
  SubmitPublish(p, d);
  if (p.trace) {
    StreamStamp(p.dev, d, kEvSubmitEnter, t_enter);
    StreamStamp(p.dev, d, kEvSubmitMatched, t_matched);
    StreamStamp(p.dev, d, kEvSubmitPublished, GlobalTimer());
  }
  if (p.wait) WaitDone(p.dev, d.ticket, p.trap, p.trace, p.timeout_ns);
}

__global__ void DoneKernel(DoneParams p) {
  WaitDone(p.dev, static_cast<uint64_t>(*p.ticket), p.trap, p.trace, p.timeout_ns);
}

}  // namespace

cudaError_t PreloadSubmitKernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, SubmitKernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, DoneKernel);
  if (e == cudaSuccess) e = PreloadInlineSubmit();
  return e;
}

cudaError_t LaunchSubmit(const SubmitParams& p, cudaStream_t stream) {
  if (p.inline_ns > 0 && p.wait && p.inline_kernel != nullptr) return LaunchInlineSubmit(p, stream);
  SubmitKernel<<<1, 1, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchDone(const DoneParams& p, cudaStream_t stream) {
  DoneKernel<<<1, 1, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dfccl::gpu
