// Host stand-ins for the device primitives that xla_ffi/device/match.cuh, wait.cuh
// and submit.cuh use, so the device's matching protocol compiles with g++ and runs
// with threads as the ranks' control warps (tests/cpp/match_stress.cc), the thread
// waits' bounds, aborts and back-off can be checked (tests/cpp/wait_helper.cc), and
// the submit kernels' execution book runs as a stream would (tests/cpp/submit_book_test.cc).
// This folder comes first on the include path there, so the headers'
// "device/primitives.cuh" is this file.
// Every word shared between ranks is accessed through std::atomic_ref with the
// order of the PTX instruction it stands for (ld/st.volatile: relaxed; acquire
// CAS; release store; acq_rel add; relaxed atom.*; fence: seq_cst); scopes (gpu,
// sys) make no difference on one host.  Plain stores through a `volatile
// MatchEntry*` stay plain: they are the entry's fields written under its bucket's
// lock.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "device/task.h"

#define DFCCL_DEV inline

// CUDA's 16-byte vector type (device/submit.cuh moves descriptors and run states in them).
struct uint4 {
  unsigned int x, y, z, w;
};
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }

namespace dfccl::gpu {

template <class T>
std::atomic_ref<T> Shared(const volatile T* p) {
  return std::atomic_ref<T>(*const_cast<T*>(p));
}

// What this thread's waits did (tests/cpp/wait_helper.cc checks device/wait.cuh's
// cadences with them): clock reads, sleeps and the nanoseconds they asked for.
struct ShimCounts {
  uint64_t clock_reads = 0, sleeps = 0, slept_ns = 0;
};
inline thread_local ShimCounts shim_counts;

inline uint64_t GlobalTimer() {
  ++shim_counts.clock_reads;
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch()).count());
}

template <class T>
T LdVol(const volatile T* p) { return Shared(p).load(std::memory_order_relaxed); }
template <class T, class V>
void StVol(volatile T* p, V v) { Shared(p).store(static_cast<T>(v), std::memory_order_relaxed); }

// One overload per width, as in the real header (so the same calls resolve).
inline uint32_t LdAcquireSys(const uint32_t* p) { return Shared(p).load(std::memory_order_acquire); }
inline uint64_t LdAcquireSys(const uint64_t* p) { return Shared(p).load(std::memory_order_acquire); }
inline void StReleaseSys(uint32_t* p, uint32_t v) { Shared(p).store(v, std::memory_order_release); }
inline void StReleaseSys(uint64_t* p, uint64_t v) { Shared(p).store(v, std::memory_order_release); }
inline void StReleaseGpu(uint32_t* p, uint32_t v) { Shared(p).store(v, std::memory_order_release); }
inline void StReleaseGpu(uint64_t* p, uint64_t v) { Shared(p).store(v, std::memory_order_release); }

inline uint32_t CasAcquire(uint32_t* p, uint32_t cmp, uint32_t val) {
  Shared(p).compare_exchange_strong(cmp, val, std::memory_order_acquire, std::memory_order_acquire);
  return cmp;  // the old value (unchanged on success)
}
inline uint32_t CasAcquireSys(uint32_t* p, uint32_t cmp, uint32_t val) { return CasAcquire(p, cmp, val); }
inline uint32_t CasAcquireGpu(uint32_t* p, uint32_t cmp, uint32_t val) { return CasAcquire(p, cmp, val); }
inline uint32_t AddAcqRelSys(uint32_t* p, uint32_t v) { return Shared(p).fetch_add(v, std::memory_order_acq_rel); }
inline void FenceAcqRelSys() { std::atomic_thread_fence(std::memory_order_acq_rel); }

// A 16-byte volatile store or load: two relaxed 8-byte halves (the PTX vector access is
// not single-copy atomic either).
inline void StVolVec(void* p, uint4 v) {
  uint64_t h[2];
  std::memcpy(h, &v, sizeof(h));
  Shared(static_cast<uint64_t*>(p)).store(h[0], std::memory_order_relaxed);
  Shared(static_cast<uint64_t*>(p) + 1).store(h[1], std::memory_order_relaxed);
}
inline uint4 LdVolVec(const void* p) {
  const uint64_t h[2] = {Shared(static_cast<const uint64_t*>(p)).load(std::memory_order_relaxed),
                         Shared(static_cast<const uint64_t*>(p) + 1).load(std::memory_order_relaxed)};
  uint4 v;
  std::memcpy(&v, h, sizeof(v));
  return v;
}

}  // namespace dfccl::gpu

// CUDA's relaxed atomics, fences and intrinsics.
inline unsigned long long atomicAnd_system(unsigned long long* p, unsigned long long v) {
  return dfccl::gpu::Shared(p).fetch_and(v, std::memory_order_relaxed);
}
inline unsigned long long atomicOr_system(unsigned long long* p, unsigned long long v) {
  return dfccl::gpu::Shared(p).fetch_or(v, std::memory_order_relaxed);
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return dfccl::gpu::Shared(p).fetch_add(v, std::memory_order_relaxed);
}
inline unsigned int atomicAdd_system(unsigned int* p, unsigned int v) {
  return dfccl::gpu::Shared(p).fetch_add(v, std::memory_order_relaxed);
}
inline unsigned long long atomicAdd_system(unsigned long long* p, unsigned long long v) {
  return dfccl::gpu::Shared(p).fetch_add(v, std::memory_order_relaxed);
}
inline unsigned int atomicCAS_system(unsigned int* p, unsigned int cmp, unsigned int val) {
  dfccl::gpu::Shared(p).compare_exchange_strong(cmp, val, std::memory_order_relaxed);
  return cmp;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __nanosleep(unsigned ns) {
  ++dfccl::gpu::shim_counts.sleeps;
  dfccl::gpu::shim_counts.slept_ns += ns;
  std::this_thread::yield();
}
[[noreturn]] inline void __trap() { std::abort(); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
inline int __popc(unsigned int v) { return __builtin_popcount(v); }
