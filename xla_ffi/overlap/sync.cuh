// Device-side flag primitives of the overlap protocol (see protocol.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device/primitives.cuh"
#include "overlap/protocol.h"

namespace dfccl::overlap {

// The project's memory-ordering and clock primitives (device/primitives.cuh).
using gpu::LdAcquireSys;
using gpu::StReleaseSys;
using gpu::GlobalTimer;
using gpu::FenceAcqRelSys;
using gpu::GridDependencyWait;


// Generic-proxy writes (by a peer, made visible to us by an acquire) become
// visible to this thread's later TMA (async-proxy) reads of global memory.
__device__ __forceinline__ void FenceProxyAsyncGlobal() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ bool Reached(uint32_t value, uint32_t seq) { return int32_t(value - seq) >= 0; }

// Strong (relaxed, system scope) store: after FenceAcqRelSys a release pattern.
__device__ __forceinline__ void StRelaxedSys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Programmatic dependent launch (gemm.cuh; the wait, GridDependencyWait, is
// device/primitives.cuh's): allow the stream's next kernel to launch once
// every CTA of this grid has called it or exited.
__device__ __forceinline__ void GridDependentsLaunch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// A timed-out or failed op never completes (protocol.h): the kernel dies, so
// the XLA execution holding it fails instead of returning a garbage result.
__device__ __forceinline__ void FailOp() {
  __threadfence_system();  // the error code (host memory) is visible before the trap
  __trap();
}

// The same at GPU scope (split-tile partials: writer and reader on one GPU).
__device__ __forceinline__ void FenceAcqRelGpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void StRelaxedGpu(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Bounded-wait bookkeeping: the timeout every kTimerPollEvery polls (the GPU's
// clock), the mailbox's error word (host memory, a PCIe read) every
// kErrorPollEvery polls, the first time only after that many.  True while the
// wait may go on; once an error is recorded (by any rank), or after timeout_ns,
// when the waiter records `code` in the mailbox (if no error is there yet),
// it does not return: FailOp traps.
__device__ __forceinline__ bool KeepWaiting(uint32_t it, uint64_t t0, Mailbox* mbox, uint64_t timeout_ns,
                                            uint32_t code) {
  if ((it % kTimerPollEvery) != kTimerPollEvery - 1) return true;
  if ((it % kErrorPollEvery) == kErrorPollEvery - 1 && *reinterpret_cast<volatile uint32_t*>(&mbox->error) != 0)
    FailOp();
  if (GlobalTimer() - t0 <= timeout_ns) return true;
  // Host memory: no system-scope atomics on PCIe hosts; a racing store of
  // another code is harmless (any one of them is reported).
  StReleaseSys(&mbox->error, code);
  FailOp();
  return false;  // not reached
}

// Waits (acquire, system scope) until *p >= seq.  Bounded: after timeout_ns the
// waiter records `code` in the mailbox (if no error is there yet) and traps;
// once any error is recorded every wait traps soon after (FailOp).  Returns
// true (the false paths of the callers are never taken).
__device__ __forceinline__ bool WaitGeq(const uint32_t* p, uint32_t seq, Mailbox* mbox, uint64_t timeout_ns,
                                        uint32_t code) {
  if (Reached(LdAcquireSys(p), seq)) return true;
  const uint64_t t0 = GlobalTimer();
  for (uint32_t it = 0;; ++it) {
    __nanosleep(100);
    if (Reached(LdAcquireSys(p), seq)) return true;
    if (!KeepWaiting(it, t0, mbox, timeout_ns, code)) return false;
  }
}

// Waits until peer q announced instance seq: its store into our ready_in slot
// (`local`, device memory; may be null) or its stream's host word ready[q]
// (`host`, polled every kHostPollEvery polls).  Either suffices (protocol.h).
__device__ __forceinline__ bool WaitReady(const uint32_t* local, const uint32_t* host, uint32_t seq, Mailbox* mbox,
                                          uint64_t timeout_ns, uint32_t code) {
  if (local == nullptr) return WaitGeq(host, seq, mbox, timeout_ns, code);
  if (Reached(LdAcquireSys(local), seq)) return true;
  const uint64_t t0 = GlobalTimer();
  for (uint32_t it = 0;; ++it) {
    __nanosleep(100);
    if (Reached(LdAcquireSys(local), seq)) return true;
    if ((it % kHostPollEvery) == kHostPollEvery - 1 && Reached(LdAcquireSys(host), seq)) return true;
    if (!KeepWaiting(it, t0, mbox, timeout_ns, code)) return false;
  }
}

__device__ __forceinline__ uint64_t LoadMailboxPtr(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

}  // namespace dfccl::overlap
