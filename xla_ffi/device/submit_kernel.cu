// The kernels a collective puts on XLA's stream (protocol: device/task.h,
// "submit", "done" and "staged"): a one-thread submit kernel, which is the task's
// ready signal, a start form's stage kernel before it, and the done kernel that
// waits and copies the slot's output out (the inline submit kernel of small blocking
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
  GridDependencyWait();  // the stream's earlier kernels complete: the input is ready, the book's line written
  const bool behind = p.book > 0 && SubmitBook(p, d, SubmitBookRead(p));  // (protocol "run": tombstones first)
  const uint64_t call = p.stage.state ? SubmitStage(p, d) : 0;
  if (behind) d.invalid = PackStatus(kStatusLeftBehind, d.rank, d.rank);
  SubmitMatch(p, d);
  if (p.stage.state) SubmitStageOwner(p, d, call);
  const uint64_t t_matched = p.trace ? GlobalTimer() : 0;
  SubmitPublish(p, d);
  if (p.trace) {
    StreamStamp(p.dev, d, kEvSubmitEnter, t_enter);
    StreamStamp(p.dev, d, kEvSubmitMatched, t_matched);
    StreamStamp(p.dev, d, kEvSubmitPublished, GlobalTimer());
  }
  if (p.wait) WaitDone(p.dev, d.ticket, p.trap, p.trace, p.timeout_ns);
}

// The execution's launch id for its captured starts (protocol "run" in device/task.h);
// the submit kernels read it after their GridDependencyWait (SubmitBookRead).
__global__ void RunWordKernel(DeviceShared* dev, uint32_t run) { StVol(&dev->run_word, run); }

// dst[0:n) = src[0:n) by the whole grid; src read past L1 (another agent wrote it).
__device__ void GridCopy(char* dst, const char* src, int64_t n) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool vec = (reinterpret_cast<uintptr_t>(dst) % 16 == 0) && (reinterpret_cast<uintptr_t>(src) % 16 == 0);
  const int64_t n16 = vec ? n / 16 : 0;
  for (int64_t i = tid; i < n16; i += stride)
    reinterpret_cast<uint4*>(dst)[i] = __ldcg(reinterpret_cast<const uint4*>(src) + i);
  for (int64_t i = n16 * 16 + tid; i < n; i += stride) dst[i] = __ldcg(src + i);
}

// A start form's copy of its operand into its call's slot (protocol "staged" in
// device/task.h), when the slot is free; else it copies nothing and says so.
__global__ void StageKernel(StageParams p) {
  SiteStage* st = p.stage.state;
  const uint64_t c = LdVol(&st->calls);
  const int k = static_cast<int>(c % kStageSlots);
  __shared__ int slot_free;
  if (threadIdx.x == 0) {
    const uint64_t owner = LdVol(&st->owner_ticket[k]);  // its previous call's task is complete
    const bool ok = owner == 0 || DoneWordReached(p.dev, static_cast<uint32_t>((owner - 1) % kTaskRing), Gen(owner - 1))();
    if (!ok) StVol(&st->skipped, c + 1);
    slot_free = ok;
  }
  __syncthreads();
  if (!slot_free) return;
  GridCopy(p.stage.slot[k], p.in, p.in_bytes);
  if (p.init) GridCopy(p.stage.slot[k] + p.stage.out_off, p.init, p.out_bytes);
}

// A start form's done, one thread: waits for the task and returns the slot its
// output is in (-1: the task failed, kStatusStageBusy included: the host reports it).
__device__ int ResolveDone(const DoneParams& p, bool trace) {
  const uint64_t t = static_cast<uint64_t>(LdVol(p.ticket));
  WaitDone(p.dev, t, p.trap, trace, p.timeout_ns);
  int slot = -1;
  for (int s = 0; s < kStageSlots; ++s)
    if (LdVol(&p.stage.state->owner_ticket[s]) == t + 1) slot = s;
  const bool ok = LdVol(&p.dev->status[t % kTaskRing]) == kStatusOk;
  if (ok && slot < 0) {  // a later start took the slot: its output is gone
    printf("dfccl: the done of ticket %llu found its staging slot taken by a later start of the same call site "
           "(more than %d starts of one call site in flight before their dones)\n",
           static_cast<unsigned long long>(t), kStageSlots);
    __trap();
  }
  return ok ? slot : -1;
}

// A start form's done of one copy block: waits, then copies its slot's output
// into the done's result (nothing when the task failed).
__global__ void StagedDoneKernel(DoneParams p) {
  GridDependencyWait();  // the ticket and the slot's owner (written by the start's submit kernel)
  __shared__ int slot;
  if (threadIdx.x == 0) slot = ResolveDone(p, p.trace);
  __syncthreads();
  if (slot >= 0) GridCopy(p.result, p.stage.slot[slot] + p.stage.out_off, p.out_bytes);
}

// A larger done, in two kernels: one block waits and leaves the slot in the
// site's header; then the copy kernel's grid copies.  (One kernel whose every
// block waits would hold up to 64 SMs while the daemon needs them: measured, a
// 4 MiB start/done across two processes under MPS never completed.)
__global__ void StagedDoneWaitKernel(DoneParams p) {
  GridDependencyWait();
  if (threadIdx.x == 0) StVol(&p.stage.state->done_slot, static_cast<uint64_t>(ResolveDone(p, p.trace) + 1));
}
__global__ void StagedCopyKernel(DoneParams p) {
  GridDependencyWait();  // the wait kernel is complete: its slot word is written
  const int slot = static_cast<int>(LdVol(&p.stage.state->done_slot)) - 1;
  if (slot >= 0) GridCopy(p.result, p.stage.slot[slot] + p.stage.out_off, p.out_bytes);
}

// Blocks of a copy of `bytes` (64 KiB a block, at most 64).
int CopyBlocks(int64_t bytes) {
  const int64_t b = (bytes + (64 << 10) - 1) / (64 << 10);
  return static_cast<int>(b < 1 ? 1 : b > 64 ? 64 : b);
}

}  // namespace

cudaError_t PreloadSubmitKernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, SubmitKernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, StageKernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, StagedDoneKernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, StagedDoneWaitKernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, StagedCopyKernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, RunWordKernel);
  if (e == cudaSuccess) e = PreloadInlineSubmit();
  return e;
}

// One block of `threads`; pdl: with programmatic stream serialization (the
// kernel's launch overlaps the end of the stream's previous kernel; it waits for
// that kernel's completion itself, GridDependencyWait, before it depends on it).
template <class P>
cudaError_t LaunchOneBlock(void (*kernel)(P), const P& p, int threads, cudaStream_t stream, bool pdl, int blocks = 1) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(blocks);
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
  const int blocks = CopyBlocks(p.out_bytes);
  if (blocks == 1) return LaunchOneBlock(&StagedDoneKernel, p, 256, stream, pdl);
  const cudaError_t e = LaunchOneBlock(&StagedDoneWaitKernel, p, 32, stream, pdl);
  return e != cudaSuccess ? e : LaunchOneBlock(&StagedCopyKernel, p, 256, stream, pdl, blocks);
}

cudaError_t LaunchRunWord(DeviceShared* dev, uint32_t run, cudaStream_t stream) {
  RunWordKernel<<<1, 1, 0, stream>>>(dev, run);
  return cudaGetLastError();
}

cudaError_t LaunchStage(const StageParams& p, cudaStream_t stream) {  // no PDL: it reads the operand at once
  return LaunchOneBlock(&StageKernel, p, 256, stream, false,
                        CopyBlocks(p.in_bytes > p.out_bytes ? p.in_bytes : p.out_bytes));
}

}  // namespace dfccl::gpu
