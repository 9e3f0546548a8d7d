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
  SubmitTake(p, d);
  GridDependencyWait();  // the stream's earlier kernels complete: the input is ready
  SubmitMatch(p, d);
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
  GridDependencyWait();  // the ticket (written by the start's submit kernel)
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

// One block of `threads`; pdl: with programmatic stream serialization (the
// kernel's launch overlaps the end of the stream's previous kernel; it waits for
// that kernel's completion itself, GridDependencyWait, before it depends on it).
template <class P>
cudaError_t LaunchOneBlock(void (*kernel)(P), const P& p, int threads, cudaStream_t stream, bool pdl) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(1);
  cfg.blockDim = dim3(threads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (pdl) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

cudaError_t LaunchSubmit(const SubmitParams& p, cudaStream_t stream, bool pdl) {
  if (p.inline_ns > 0 && p.wait && p.inline_kernel != nullptr)
    return LaunchOneBlock(p.inline_kernel, p, kThreads, stream, pdl);
  return LaunchOneBlock(&SubmitKernel, p, 1, stream, pdl);
}

cudaError_t LaunchDone(const DoneParams& p, cudaStream_t stream, bool pdl) {
  return LaunchOneBlock(&DoneKernel, p, 1, stream, pdl);
}

}  // namespace dfccl::gpu
