// Device-side flag primitives of the overlap protocol (see protocol.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device/primitives.cuh"
#include "device/wait.cuh"
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

// The same at GPU scope (split-tile partials: writer and reader on one GPU).
__device__ __forceinline__ void FenceAcqRelGpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void StRelaxedGpu(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The overlap ops' flag waits, through the device's one wait (device/wait.cuh
// SpinWait): 100 ns between polls, the clock every kTimerPollEvery polls, the
// mailbox's error word (host memory, a PCIe read) every kErrorPollEvery polls,
// the first time only after that many (a short wait makes no PCIe read).
struct FlagWait : gpu::WaitPolicy {
  static constexpr uint32_t kClockEvery = kTimerPollEvery;
  static constexpr uint32_t kAbortEvery = kErrorPollEvery;
  static __device__ __forceinline__ void Sleep(uint32_t) { __nanosleep(100); }
};

// Waits until `ready` (polled with its index: device/wait.cuh).  A timed-out or
// failed op never completes (protocol.h): once an error is recorded (by any
// rank) the waiter traps; after timeout_ns it records `code` in the mailbox
// (host memory: no system-scope atomics on PCIe hosts; a racing store of
// another code is harmless, any one of them is reported), then traps.  The
// fence puts the code in host memory before the kernel dies; the trap fails
// the XLA execution holding the op instead of returning a garbage result.
// Returns true (the false paths of the callers are never taken).
template <class Ready>
__device__ __forceinline__ bool WaitFlag(Ready&& ready, Mailbox* mbox, uint64_t timeout_ns, uint32_t code) {
  gpu::SpinWaitOrTrap<FlagWait>(
      ready, timeout_ns, [&] { return *reinterpret_cast<volatile uint32_t*>(&mbox->error) != 0; },
      [&](gpu::WaitEnd end) {
        if (end == gpu::WaitEnd::kBound) StReleaseSys(&mbox->error, code);
        __threadfence_system();
      });
  return true;
}

// Waits (acquire, system scope) until *p >= seq (WaitFlag's bound and failure).
__device__ __forceinline__ bool WaitGeq(const uint32_t* p, uint32_t seq, Mailbox* mbox, uint64_t timeout_ns,
                                        uint32_t code) {
  return WaitFlag([&] { return Reached(LdAcquireSys(p), seq); }, mbox, timeout_ns, code);
}

// Waits until peer q announced instance seq: its store into our ready_in slot
// (`local`, device memory; may be null) or its stream's host word ready[q]
// (`host`, polled every kHostPollEvery polls; every poll when `local` is null).
// Either suffices (protocol.h).
__device__ __forceinline__ bool WaitReady(const uint32_t* local, const uint32_t* host, uint32_t seq, Mailbox* mbox,
                                          uint64_t timeout_ns, uint32_t code) {
  if (local == nullptr) return WaitGeq(host, seq, mbox, timeout_ns, code);
  // Poll n (0: the first): the host word at polls kHostPollEvery + 1, 2 kHostPollEvery + 1, ...
  return WaitFlag(
      [&](uint32_t n) {
        return Reached(LdAcquireSys(local), seq) ||
               (n != 0 && ((n - 1) % kHostPollEvery) == kHostPollEvery - 1 && Reached(LdAcquireSys(host), seq));
      },
      mbox, timeout_ns, code);
}

__device__ __forceinline__ uint64_t LoadMailboxPtr(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

}  // namespace dfccl::overlap
