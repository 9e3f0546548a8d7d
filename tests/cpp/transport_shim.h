// The transport of xla_ffi/transport/transport.cuh on the host, for threads as
// ranks (tests/cpp/announce_stress.cc): each rank's symmetric region is a host
// buffer; a put copies, then adds to the signal with a release RMW (so a reader
// that acquires the signal sees the bytes: race-free in C++'s model, hence under
// TSan too); a knob delays every put between two "hosts" by L µs (the network),
// and a rank can be killed (its puts stop, it stops draining, and the liveness
// mask, the proxy's report on the GPU, names it).

#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "device/primitives.cuh"  // tests/cpp/device_shim's
#include "transport/transport.cuh"

namespace dfccl::gpu::shim {

// The ranks' regions and what the network does to them.
class World {
 public:
  World(int nranks, int ranks_per_host, uint64_t bytes, int latency_us = 0)
      : nranks_(nranks), per_host_(ranks_per_host), latency_us_(latency_us) {
    for (int r = 0; r < nranks; ++r) {
      // 64-byte aligned and zeroed, as a fresh device allocation's words that peers write.
      region_.emplace_back(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)), &std::free);
      std::memset(region_.back().get(), 0, bytes);
    }
  }
  int Ranks() const { return nranks_; }
  char* Region(int r) { return region_[r].get(); }
  bool SameHost(int a, int b) const { return a / per_host_ == b / per_host_; }
  int LatencyUs() const { return latency_us_; }
  uint64_t Dead() const { return dead_.load(std::memory_order_acquire); }
  void Kill(int r) { dead_.fetch_or(1ull << r, std::memory_order_acq_rel); }

 private:
  int nranks_, per_host_, latency_us_;
  std::vector<std::unique_ptr<char, decltype(&std::free)>> region_;
  std::atomic<uint64_t> dead_{0};
};

// Rank `rank`'s transport (the contract of transport.cuh).
struct Transport {
  static constexpr int kPolled = 512;  // distinct words (rings, acknowledgements, slots' signals)
  World* w;
  int rank;
  uint64_t* polled[kPolled] = {};  // words polled since the last Acquire
  int npolled = 0;

  int Rank() const { return rank; }
  int Ranks() const { return w->Ranks(); }
  char* Local(uint64_t off) { return w->Region(rank) + off; }
  uint64_t DeadMask() const { return w->Dead(); }

  bool Put(int peer, uint64_t dst_off, const void* src, uint32_t bytes, uint64_t signal_off, uint64_t add) {
    const uint64_t dead = DeadMask();
    if ((dead >> peer | dead >> rank) & 1ull) return false;
    if (w->LatencyUs() > 0 && !w->SameHost(rank, peer))
      std::this_thread::sleep_for(std::chrono::microseconds(w->LatencyUs()));
    if (bytes > 0) std::memcpy(w->Region(peer) + dst_off, src, bytes);
    std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(w->Region(peer) + signal_off))
        .fetch_add(add, std::memory_order_acq_rel);
    return true;
  }
  bool PutValue(int peer, uint64_t off, uint64_t v) {
    const uint64_t dead = DeadMask();
    if ((dead >> peer | dead >> rank) & 1ull) return false;
    std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(w->Region(peer) + off)).store(v, std::memory_order_release);
    return true;
  }
  uint64_t Signal(uint64_t off) {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(Local(off))).load(std::memory_order_acquire);
  }
  // Poll, then Acquire: as the GPU's relaxed load and system fence.  ThreadSanitizer
  // does not model a standalone fence, so Acquire is an acquire load of each word
  // polled since the last one (it reads the polled value or a later one of the same
  // word, so it synchronizes with the same writes: the polls' ordering, nothing more).
  uint64_t Poll(uint64_t off) {
    uint64_t* p = reinterpret_cast<uint64_t*>(Local(off));
    int i = 0;
    while (i < npolled && polled[i] != p) ++i;
    if (i == npolled && npolled < kPolled) polled[npolled++] = p;
    else if (i == npolled) std::atomic_ref<uint64_t>(*p).load(std::memory_order_acquire);  // (past the list: at once)
    return std::atomic_ref<uint64_t>(*p).load(std::memory_order_relaxed);
  }
  void Acquire() {
    for (int i = 0; i < npolled; ++i) std::atomic_ref<uint64_t>(*polled[i]).load(std::memory_order_acquire);
    npolled = 0;
  }
  bool Flush(uint64_t) { return true; }  // a put is complete when it returns
};

}  // namespace dfccl::gpu::shim
