// What every part of the GPU host runtime shares: the runtime lock, the
// configuration (and its atomic copies for the lock-free hot path), the devices
// (struct Device: what is per GPU), the communicators by group, the process's
// device ids, key names, the error log, the host's trace records, the
// copy-engine mover and the IPC server.
//
// Owner: Runtime (runtime.h) holds the one Context; the communicators, the
// paths and the proxy hold a reference to it.
// Lock: `mu` guards everything here but the atomics, `by_ordinal` (lock-free
// device lookup of the done handlers), `times` and the CopyEngine/Ipc objects'
// own locks.  The handlers take it through HandlerLock (short spin), the proxy
// through Proxy::ProxyLock (timed), Pending() with a deadline; nothing holds it
// across an enqueue on XLA's streams.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dfccl/check.h"
#include "dfccl/collective.h"
#include "device/daemon.h"
#include "device/task.h"
#include "runtime/config.h"
#include "runtime/copy_engine.h"
#include "runtime/ipc.h"

namespace dfccl::gpu {

using Clock = std::chrono::steady_clock;

class Communicator;
class Proxy;
struct Instance;
struct Site;

static_assert(kMaxDaemonBlocks == kMaxBlocks, "config.h's block limit is the daemon's");
inline constexpr size_t kMaxErrors = 256;  // errors kept for stats()["errors"], newest last

inline constexpr size_t kMaxHostTrace = 65536;  // trace records kept on the host (the fused ops'), newest last

inline constexpr uint64_t kCeTicket = uint64_t{1} << 63;  // tickets of the copy-engine ring carry this bit

// One ticket of a device's ring (the daemon's or the copy engines'), as the proxy tracks it.
struct TaskInfo {
  Instance* inst = nullptr;  // copy-engine path
  const Site* site = nullptr;  // daemon path
  Communicator* comm = nullptr;
  uint64_t ticket = 0;
  Clock::time_point t;
  bool done = true;
  bool large = false;
  bool tomb = false;  // daemon path: a tombstone (protocol "run" in device/task.h)
  int64_t msg_bytes = 0;
  uint64_t key_hash = 0, seq = 0;
};

// What is per GPU: its streams, the blocks it shares with the host and its
// daemon kernel, the daemon's launch state, its recorded error.  The paths keep
// their own per-device state (DaemonPath::PerDevice, CopyEnginePath::PerDevice).
struct Device {
  int ordinal = 0;
  cudaStream_t stream = nullptr, aux = nullptr;
  cudaEvent_t ev = nullptr;
  HostShared* host = nullptr;
  HostShared* host_dev = nullptr;
  DeviceShared* dev = nullptr;
  uint64_t launches = 0;
  uint64_t map_gen = 0;                         // DaemonParams::map_gen of the latest launch
  uint64_t blocks_launched = 0;                 // daemon blocks launched (pending(): against DeviceShared::blocks_left)
  // Written under the runtime lock; read without it by the submit handler's hot
  // path (Submit: is a daemon running, is it large enough), hence atomic.
  std::atomic<uint32_t> launch_id{0};
  std::atomic<int> workers{0};
  // Processes whose ranks run on this GPU, this one included (several under MPS),
  // as the communicators' exchanges found them (Communicator::Import), and the
  // worker blocks a daemon here may have: its share of the SMs, so that the
  // daemons of every such process fit together (each block takes an SM;
  // a daemon whose lanes cannot all run waits until its stall limit).
  int sharing = 1;
  std::atomic<int> worker_cap{kMaxBlocks - 1};
  int pending_large = 0;
  std::atomic<bool> launched{false};
  Clock::time_point next_relaunch, next_peer_check;
  int64_t backoff_us = 20;
  Status error;                                            // recorded by the proxy/watchdog; thrown by the next handler call
  std::atomic<bool> has_error{false};                      // error is set (read without the lock on the hot path)
  // A collective's failure (timeout, mismatch, a dead peer, an abort): thrown once,
  // then cleared — the failed instance stays behind as a tombstone (its match
  // entry failed, the communicator's failure record), so the device's next programs run.
  // Anything else (a CUDA error, a broken invariant) stays until reset().
  bool error_once = false;
  int64_t completed = 0, failed = 0;                       // tasks seen done by the proxy (stats())
  int64_t fused_started = 0;  // fused ops' instances started (OverlapPath; the other paths count their rings)
};

// A trace record the host writes (the fused ops': OverlapPath), beside the
// daemon's device rings; event is a static string (start, run, finish, error).
struct HostTraceRec {
  int device;
  uint64_t key_hash, seq;
  const char* event;
  uint64_t t_ns;  // host clock, ns since the epoch
};

// Copies device memory out on the device's private stream and waits for it
// (never waits on XLA's streams); throws on a CUDA error.
void CopyOut(Device& d, void* dst, const void* src, size_t bytes);

// Lanes of a task and the bytes each moves (a multiple of 16): at least
// lane_min bytes a lane, at most the pool's lanes and the daemon's workers.
inline std::pair<int, int64_t> LanePlan(int64_t msg_bytes, const PoolGeom& g, int workers, int64_t lane_min) {
  const int64_t per = lane_min > 16 ? lane_min : 16;
  int64_t lanes = (msg_bytes + per - 1) / per;
  if (lanes < 1) lanes = 1;
  if (lanes > g.lanes) lanes = g.lanes;
  if (lanes > workers) lanes = workers > 0 ? workers : 1;
  const int64_t lane_bytes = ((msg_bytes + lanes - 1) / lanes + 15) / 16 * 16;
  return {static_cast<int>(lanes), lane_bytes};
}

// Host time spent per collective on XLA's threads (means reported by stats()):
// inside the start and done handlers, in their stream memory operations, and
// between consecutive handler calls on one thread (XLA's own per-op work).
struct HostTimes {
  std::atomic<int64_t> start_ns{0}, done_ns{0}, streamop_ns{0}, gap_ns{0};
  std::atomic<int64_t> starts{0}, dones{0}, gaps{0};
};

// What the kernels of one call need to know (Context::FlagsFor).
struct KernelFlags {
  int32_t trap, trace;
  int64_t timeout_ns;
};

std::string GroupText(const std::vector<int64_t>& group);

struct Context {
  // Under mu (the caller holds it) unless said otherwise.
  std::unique_lock<std::timed_mutex> HandlerLock();  // takes mu
  void RecordError(const std::string& message);     // stats()["errors"]
  Device& GetDevice(int ordinal);
  // The worker blocks of d's daemon for large tasks: cfg.large_workers() within d's
  // share of the SMs (Device::worker_cap), never below cfg.workers().  Also without mu.
  int LargeWorkers(const Device& d) const {
    const int cap = d.worker_cap.load(std::memory_order_relaxed);
    const int want = large_workers.load(std::memory_order_relaxed);
    return want < cap ? want : (cap > cfg.workers() ? cap : cfg.workers());
  }
  // d is shared by `processes` processes (this one included): its worker cap follows.
  void SetSharing(Device& d, int processes);
  Device& GetDeviceFast(int ordinal);  // a device already set up (no lock)
  int OrdinalOf(int64_t global) const;  // -1: another process's device
  int64_t GlobalOf(int ordinal) const;  // also without mu (the handlers): the ids are set before any collective
  Communicator& GetComm(const std::vector<int64_t>& group);
  KernelFlags FlagsFor(cudaStream_t stream);  // no lock
  void ThrowIfFailed(Device& d);              // no lock unless d has an error
  // Throws d.error (the caller holds the lock); a collective's failure is thrown once.
  [[noreturn]] void ThrowDeviceError(Device& d);

  alignas(64) std::timed_mutex mu;  // timed: the proxy and Pending() must not wait for it blindly
  std::atomic<double> timeout_s{0.0};                  // cfg.timeout_s (set by Configure), readable without mu
  std::atomic<bool> trace{false};                      // cfg.trace, readable without mu
  std::atomic<int> large_workers{0};                   // cfg.large_workers(), readable without mu
  std::atomic<int64_t> inline_ns{0}, spin_ns{0};       // cfg.inline_ns(), cfg.spin_ns(), readable without mu
  std::atomic<int> sticky_max{0};                      // cfg.sticky_max(), readable without mu
  std::atomic<bool> pdl{false};                        // cfg.submit_pdl, readable without mu
  std::array<std::atomic<Device*>, 64> by_ordinal{};   // devices for the lock-free done path
  std::atomic<const char*> busy_in{"nothing known"};   // a CUDA call made under mu that may block
  alignas(64) HostTimes times;  // its own cache lines, not the lock's
  Config cfg;
  std::map<int, std::unique_ptr<Device>> devices;
  std::map<std::vector<int64_t>, std::unique_ptr<Communicator>> comms;
  std::map<int64_t, int> ordinal_of;  // empty in one process (ids are ordinals)
  std::map<int, int64_t> global_of;
  std::unordered_map<uint64_t, std::string> key_names;
  std::vector<std::string> errors;
  std::deque<HostTraceRec> host_trace;  // while cfg.trace, at most kMaxHostTrace
  Proxy* proxy = nullptr;  // started by the first device (GetDevice)
  // The daemon's build (device/daemon.h): this module's, or _dfccl_nvshmem's once
  // NVSHMEM is set up (Runtime::SetDaemonEngine, before the first device).
  const DaemonEngine* engine = &ThisDaemonEngine();
  // Devices of processes the job lost (Runtime::SetLostDevices: jax_dfccl.initialize's
  // liveness watch over the key-value store, for ranks on other hosts): global id ->
  // what was seen.  Under lost_mu, not mu (the watch must never wait for a handler).
  std::mutex lost_mu;
  std::map<int64_t, std::string> lost;
  std::atomic<int> nlost{0};
  CopyEngine ce;
  Ipc ipc;
};

}  // namespace dfccl::gpu
