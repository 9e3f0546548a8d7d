// The transport under the daemon's cross-host protocols (docs/design/scale-out.md §5.1):
// one-sided puts with a completion signal into a peer's *symmetric* region (the
// same layout, so the same offsets, on every rank), local signal reads and waits,
// and a bounded flush.  No remote atomics, no fetches: that is all protocol C
// (transport/announce.cuh) needs, and all that NCCL's GIN offers.
//
// The contract (a struct the protocol takes as a template parameter: no virtual
// calls on the device; every member is non-blocking unless it says it is bounded):
//
//   int Rank() const, Ranks() const     this rank and the communicator's size
//   char* Local(uint64_t off)           this rank's own region at `off`
//   bool Put(int peer, uint64_t dst_off, const void* src, uint32_t bytes,
//            uint64_t signal_off, uint64_t add)
//       copies `bytes` from src into peer's region at dst_off, then adds `add` to
//       the peer's u64 signal word at signal_off, strongly: a peer that reads the
//       signal with Signal() and sees the add also sees the bytes.  bytes may be 0
//       (a signal alone).  `src` may be reused once Flush returned true.  False:
//       the peer is known dead (DeadMask): nothing was sent.
//   bool PutValue(int peer, uint64_t off, uint64_t v)
//       an 8-byte store into peer's region, ordered after this rank's earlier
//       reads and writes (a reader that sees v sees them); for credits.
//   uint64_t Signal(uint64_t off)       an acquire read of this rank's own word
//   uint64_t Poll(uint64_t off)         a relaxed read of it (no ordering: a poll that
//                                       costs no cache invalidation; a caller about to
//                                       act on what the word guards calls Acquire first)
//   void Acquire()                      orders this thread's later reads and writes after
//                                       its earlier Polls: Poll, then Acquire, is Signal
//   bool Flush(uint64_t bound_ns)       every earlier put of this rank complete at
//                                       its target; false at the bound (never waits longer)
//   uint64_t DeadMask() const           ranks the host found dead (the proxy's liveness
//                                       report, in local memory: docs/design/scale-out.md §8)
//   bool PutWarp(int lane, <Put's arguments>, uint64_t stage_off)   (device builds only)
//       Put by the 32 threads of a warp, each calling it with the same arguments
//       (`lane`: its index): the bytes copied 16 at a time by every lane, then the one
//       signal add; returns the same on every lane.  stage_off: `bytes` of this rank's
//       own region the engine may copy the source into first (a network that reads only
//       memory registered with it); the caller keeps it for this message until a Flush.
//       The daemon's control warp ships a message this way (device/announce_path.cuh);
//       a record stays one thread's Put.
//
// Waits on a signal go through WaitSignal below, i.e. the one wait of the device
// (device/wait.cuh): bounded, with an abort check; an engine's own unbounded
// wait is never used.
//
// Engines (not built yet: they need the GPU build):
//  - NVSHMEM: Put = nvshmem_putmem_signal_nbi(base + dst_off, src, bytes, base +
//    signal_off, add, NVSHMEM_SIGNAL_ADD, pe); PutValue = a fence, then
//    nvshmem_uint64_p; Signal = nvshmem_signal_fetch; Flush = nvshmem_quiet, which
//    has no timeout (its bound is the host's watchdog).  nvshmem_signal_wait_until
//    is unbounded, hence WaitSignal polls Signal instead.
//  - NCCL GIN: Put = put with a strong VA-signal add at signal_off; PutValue =
//    putValue; Flush = flush with timeoutCycles.
//  - StoreTransport below: peers reached by pointer (NVLink peer access, CUDA IPC).
#pragma once

#include <cstdint>

#include "device/primitives.cuh"
#include "device/wait.cuh"

namespace dfccl::gpu {

inline constexpr int kTransportMaxRanks = 64;  // masks are u64

// A signal word's wait (WaitSignal): polls of this GPU's own memory, 64 at once,
// then 64 ns apart; the clock and the abort check every 256 polls.
struct SignalWait : WaitPolicy {
  static constexpr uint32_t kClockEvery = 256;
  static constexpr uint32_t kAbortEvery = 256;
  static DFCCL_DEV void Sleep(uint32_t it) {
    if (it > 64) __nanosleep(64);
  }
};

// Waits until this rank's signal at `off` reaches `target` (signals only grow).
template <class Transport, class Abort = NoAbort>
DFCCL_DEV WaitEnd WaitSignal(Transport& t, uint64_t off, uint64_t target, uint64_t bound_ns, Abort&& aborted = Abort{}) {
  return SpinWait<SignalWait>([&] { return t.Signal(off) >= target; }, bound_ns, aborted);
}

#if defined(__CUDACC__)
// dst[0:n) = src[0:n) by the 32 lanes of a warp: 16-byte vectors when both are
// aligned (CopyVec16, loads through L2: the source is XLA's buffer, rewritten
// between uses while a persistent kernel's L1 may still hold its old lines), the
// rest (or all, unaligned) bytewise.
DFCCL_DEV void WarpCopy(int lane, char* dst, const char* src, uint32_t n) {
  uint32_t i = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15u) == 0) {
    CopyVec16<32>(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), n >> 4, lane);
    i = n >> 4 << 4;
  }
  for (uint32_t b = i + lane; b < n; b += 32) dst[b] = static_cast<char>(__ldcg(reinterpret_cast<const unsigned char*>(src) + b));
}
#endif

// Peers reached by pointer: base[r] is rank r's region as this GPU sees it
// (base[rank] the own one).  A put is the thread's stores, then a release fence
// at system scope, then a relaxed add on the signal: the fence orders the
// stores before the add for any reader that acquires the signal.
struct StoreTransport {
  int rank = 0, nranks = 0;
  char* base[kTransportMaxRanks] = {};
  const uint64_t* dead = nullptr;  // the proxy's dead-rank mask (local; null: none)

  DFCCL_DEV int Rank() const { return rank; }
  DFCCL_DEV int Ranks() const { return nranks; }
  DFCCL_DEV char* Local(uint64_t off) { return base[rank] + off; }
  DFCCL_DEV uint64_t DeadMask() const { return dead ? LdVol(dead) : 0ull; }

  DFCCL_DEV bool Put(int peer, uint64_t dst_off, const void* src, uint32_t bytes, uint64_t signal_off, uint64_t add) {
    if (DeadMask() >> peer & 1ull) return false;
    char* dst = base[peer] + dst_off;
    const char* s = static_cast<const char*>(src);
    uint32_t i = 0;
    if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(s)) & 7u) == 0)
      for (; i + 8 <= bytes; i += 8) *reinterpret_cast<uint64_t*>(dst + i) = LdVol(reinterpret_cast<const uint64_t*>(s + i));
    for (; i < bytes; ++i) dst[i] = LdVol(s + i);  // (volatile: past a persistent kernel's L1, as the lanes read)
    FenceAcqRelSys();
    atomicAdd_system(reinterpret_cast<unsigned long long*>(base[peer] + signal_off), add);
    return true;
  }
#if defined(__CUDACC__)
  // Every lane's stores, its system-scope fence, the warp's barrier, then lane 0's
  // add: a reader that sees the add sees every lane's bytes (fences are cumulative).
  DFCCL_DEV bool PutWarp(int lane, int peer, uint64_t dst_off, const void* src, uint32_t bytes, uint64_t signal_off,
                         uint64_t add, uint64_t) {
    if (__shfl_sync(0xffffffffu, lane == 0 ? DeadMask() >> peer & 1ull : 0ull, 0)) return false;
    WarpCopy(lane, base[peer] + dst_off, static_cast<const char*>(src), bytes);
    FenceAcqRelSys();
    __syncwarp();
    if (lane == 0) atomicAdd_system(reinterpret_cast<unsigned long long*>(base[peer] + signal_off), add);
    __syncwarp();
    return true;
  }
#endif
  DFCCL_DEV bool PutValue(int peer, uint64_t off, uint64_t v) {
    if (DeadMask() >> peer & 1ull) return false;
    StReleaseSys(reinterpret_cast<uint64_t*>(base[peer] + off), v);
    return true;
  }
  DFCCL_DEV uint64_t Signal(uint64_t off) { return LdAcquireSys(reinterpret_cast<const uint64_t*>(Local(off))); }
  DFCCL_DEV uint64_t Poll(uint64_t off) { return LdVol(reinterpret_cast<const uint64_t*>(Local(off))); }
  DFCCL_DEV void Acquire() { FenceAcqRelSys(); }
  // Stores are complete at the peer once the fence of each put passed.
  DFCCL_DEV bool Flush(uint64_t) { return true; }
};

// A test setting over any transport: the ranks of other "hosts" (`remote`, a
// mask), every put or value to one of them issued only after delay_ns more (the
// network's latency, simulated on one host: docs/design/scale-out.md §6;
// config.testing.cross_host_latency_us in the daemon).  The sending thread (or
// warp) waits meanwhile, as the host shim's sender does (tests/cpp/transport_shim.h),
// so one sender's puts to remote ranks follow each other.  delay_ns 0: no delay.
template <class T>
struct DelayedTransport : T {
  uint64_t remote = 0;
  uint64_t delay_ns = 0;

  // Consecutive ranks_per_host ranks a host (0: one host), as seen from `rank`.
  DFCCL_TASK_HD static uint64_t RemoteOf(int rank, int nranks, int ranks_per_host) {
    uint64_t m = 0;
    for (int q = 0; q < nranks && ranks_per_host > 0; ++q)
      if (q / ranks_per_host != rank / ranks_per_host) m |= 1ull << q;
    return m;
  }
  DFCCL_DEV bool Remote(int peer) const { return remote >> peer & 1ull; }
  DFCCL_DEV void Delay(int peer) const {
    if (delay_ns == 0 || !Remote(peer)) return;
    const uint64_t t0 = GlobalTimer();
    while (!Elapsed(t0, delay_ns)) {
    }
  }
  DFCCL_DEV bool Put(int peer, uint64_t dst_off, const void* src, uint32_t bytes, uint64_t signal_off, uint64_t add) {
    Delay(peer);
    return T::Put(peer, dst_off, src, bytes, signal_off, add);
  }
  DFCCL_DEV bool PutValue(int peer, uint64_t off, uint64_t v) {
    Delay(peer);
    return T::PutValue(peer, off, v);
  }
#if defined(__CUDACC__)
  DFCCL_DEV bool PutWarp(int lane, int peer, uint64_t dst_off, const void* src, uint32_t bytes, uint64_t signal_off,
                         uint64_t add, uint64_t stage_off) {
    Delay(peer);
    return T::PutWarp(lane, peer, dst_off, src, bytes, signal_off, add, stage_off);
  }
#endif
};

}  // namespace dfccl::gpu
