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

// Release/acquire fence at system scope; cumulative: after a bar.sync it also
// orders the other participating threads' earlier stores (PTX memory model).
__device__ __forceinline__ void FenceAcqRelSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }


// Generic-proxy writes (by a peer, made visible to us by an acquire) become
// visible to this thread's later TMA (async-proxy) reads of global memory.
__device__ __forceinline__ void FenceProxyAsyncGlobal() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ bool Reached(uint32_t value, uint32_t seq) { return int32_t(value - seq) >= 0; }

// Waits (acquire, system scope) until *p >= seq.  Bounded: after timeout_ns the
// waiter records `code` in the mailbox (if no error is there yet) and returns
// false; once any error is recorded every wait returns false at once.
__device__ __forceinline__ bool WaitGeq(const uint32_t* p, uint32_t seq, Mailbox* mbox, uint64_t timeout_ns,
                                        uint32_t code) {
  if (Reached(LdAcquireSys(p), seq)) return true;
  const uint64_t t0 = GlobalTimer();
  for (uint32_t it = 0;; ++it) {
    __nanosleep(100);
    if (Reached(LdAcquireSys(p), seq)) return true;
    if ((it & 127) == 0) {
      if (*reinterpret_cast<volatile uint32_t*>(&mbox->error) != 0) return false;
      if (GlobalTimer() - t0 > timeout_ns) {
        // Host memory: no system-scope atomics on PCIe hosts; a racing store of
        // another code is harmless (any one of them is reported).
        StReleaseSys(&mbox->error, code);
        return false;
      }
    }
  }
}

__device__ __forceinline__ uint64_t LoadMailboxPtr(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

}  // namespace dfccl::overlap
