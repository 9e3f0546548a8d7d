// Host-side internals of the fused overlap ops shared by their handlers
// (ffi/overlap_handlers.cc) and profile.cc: the CUDA error check, the device
// guard, and the diagnostics: the no_comm and profile switches (SetDiag),
// CUDA-event timings of
// kernels and side-stream transfers, handler wall time, and the device
// timeline of each profiled launch (protocol.h kTlWords), collected and
// cleared by ProfileResults().  Diagnostics cost nothing unless profiling.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dfccl/check.h"
#include "runtime/driver.h"

#define OV_CUDA(call) DFCCL_CHECK_CUDA(call, "dfccl overlap")

namespace dfccl::overlap {
using gpu::DeviceGuard;  // runtime/driver.h

// Diagnostics (module functions _set_diag, _profile_results): no_comm (fused
// GEMM without waits or remote stores; results invalid) and profile (CUDA-event
// time of every fused GEMM kernel and side-stream transfer, plus the device
// timeline of every launch summarized per launch; collected and cleared by
// ProfileResults: (op key|gemm[_nocomm] / |push / |copy / |host / |tl_<what>,
// ms); tl_* are described at Summarize in profile.cc).
void SetDiag(bool no_comm, bool profile);
std::vector<std::pair<std::string, float>> ProfileResults();
}  // namespace dfccl::overlap

namespace dfccl::overlap::prof {

extern std::atomic<bool> g_no_comm, g_profile;

inline bool Profiling() { return g_profile.load(std::memory_order_relaxed); }
inline bool NoComm() { return g_no_comm.load(std::memory_order_relaxed); }

// One profiled launch's device timeline.
struct Timeline {
  std::string key;
  int ordinal = 0, kind = 0, rank = 0, nranks = 1, per_block = 0, tiles = 0, grid = 1, side = 0;
  uint64_t* dev = nullptr;     // tiles * kTlWords + kMaxRanks * kTlSide words (device)
  cudaEvent_t done = nullptr;  // recorded by KeepTimeline
  int64_t host_ns = 0;         // system clock at the handler's entry (ns since the epoch)
};

// Zeroed timeline words, stream-ordered (profile only; else null).
uint64_t* TimelineAlloc(cudaStream_t s, size_t words);
// Keeps `t` for ProfileResults; after everything that writes it on `s`.
void KeepTimeline(Timeline t, cudaStream_t s);
// A timing event recorded on `s` (profile only; else null).
cudaEvent_t Mark(cudaStream_t s);
// Keeps "<key><what>" = elapsed(a, b) (profile only: a or b null does nothing).
void Keep(std::string_view key, const char* what, cudaEvent_t a, cudaEvent_t b);
void KeepHost(std::string_view key, float ms);

int64_t HostNowNs();

class HostTimer {  // "<key>|host": wall time of one handler call (profile only)
 public:
  explicit HostTimer(std::string_view key) : key_(key), t0_(std::chrono::steady_clock::now()) {}  // no copy: hot path
  ~HostTimer() {
    if (Profiling())
      KeepHost(key_, std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - t0_).count());
  }

 private:
  std::string_view key_;  // the custom call's attribute, alive for the whole call
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace dfccl::overlap::prof
