// The GPU host runtime: devices (daemon, queues), communicators (staging
// pools, instance matching), the proxy thread (completions, relaunch, watchdog).
//
// Matching: an instance is (communicator, key_hash, seq); seq counts this
// rank's starts of the key.  The first rank to start an instance gives it an
// instance slot of its pool (or queues it until one is free); later ranks find
// it by (key_hash, seq), so the order of starts on each rank does not matter.
// This host-side rendezvous is the single-process part: with CUDA IPC across
// processes, slot assignment must become a function of (key_hash, seq) agreed
// without a shared host table (e.g. through the distributed KV store).
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
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "dfccl/check.h"
#include "dfccl/collective.h"
#include "device/task.h"
#include "runtime/config.h"
#include "runtime/copy_engine.h"

namespace dfccl::gpu {

using Clock = std::chrono::steady_clock;

struct Device;

struct Instance {
  uint64_t key_hash = 0, seq = 0;
  std::string key, signature;
  int pool = 0, slot = -1, nranks = 0, done = 0;
  uint32_t epoch = 0, started = 0;
  bool failed = false;
  bool ce = false;                                  // copy-engine path (pool -1, no slot)
  std::vector<std::pair<Device*, uint64_t>> tasks;  // (device, ticket); kCeTicket marks the copy-engine ring
  std::vector<CeRank> ce_ranks;                     // per rank, filled as ranks start (copy-engine path)
};

static_assert(kMaxDaemonBlocks == kMaxBlocks, "config.h's block limit is the daemon's");
inline constexpr size_t kMaxErrors = 256;  // errors kept for stats()["errors"], newest last

inline constexpr uint64_t kCeTicket = uint64_t{1} << 63;  // tickets of the copy-engine ring carry this bit

struct Comm {
  std::vector<int> ordinals;
  int n = 0;
  bool direct = false;  // pool-1 instances take the direct path (Config::direct when created)
  CommDev view{};
  std::vector<CommDev*> dev_copy;           // per rank, on its device
  std::vector<std::pair<int, void*>> allocs;
  int64_t bytes = 0;
  std::vector<int> free_slots[kNumPools];
  std::vector<uint32_t> epochs[kNumPools];
  std::deque<Instance*> waiting[kNumPools];
  std::map<std::pair<uint64_t, uint64_t>, std::unique_ptr<Instance>> live;
  std::map<std::pair<uint64_t, uint64_t>, std::unique_ptr<Instance>> failed;
};

struct TaskInfo {
  Instance* inst = nullptr;
  Comm* comm = nullptr;
  uint64_t ticket = 0;
  Clock::time_point t;
  bool done = true;
  bool large = false;
  int64_t msg_bytes = 0;
  uint64_t key_hash = 0, seq = 0;
};

struct Device {
  int ordinal = 0;
  cudaStream_t stream = nullptr, aux = nullptr;
  cudaEvent_t ev = nullptr;
  HostShared* host = nullptr;
  HostShared* host_dev = nullptr;
  DeviceShared* dev = nullptr;
  uint64_t next_ticket = 0, oldest = 0, launches = 0;
  uint32_t launch_id = 0;
  int workers = 0;
  int pending_large = 0;
  bool launched = false;
  Clock::time_point next_relaunch;
  int64_t backoff_us = 20;
  std::array<TaskInfo, kTaskRing> info;
  std::array<TaskInfo, kCeRing> ce_info;  // copy-engine collectives (tickets ce_oldest .. ce_next)
  uint64_t ce_next = 0, ce_oldest = 0;
  std::map<std::pair<Comm*, uint64_t>, uint64_t> seq;
  std::unordered_map<int64_t, std::deque<uint64_t>> fifo;  // start/done pairing per site
  Status error;                                            // recorded by the proxy/watchdog; thrown by the next handler call
  int64_t completed = 0, failed = 0;                       // tasks seen done by the proxy (stats())
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

struct TraceOut {
  int device;
  std::string key;
  uint64_t seq;
  std::string event;
  uint64_t t_ns;
};

// Host time spent per collective on XLA's threads (means reported by stats()):
// inside the start and done handlers, in their stream memory operations, and
// between consecutive handler calls on one thread (XLA's own per-op work).
struct HostTimes {
  std::atomic<int64_t> start_ns{0}, done_ns{0}, streamop_ns{0}, gap_ns{0};
  std::atomic<int64_t> starts{0}, dones{0}, gaps{0};
};

class Runtime {
 public:
  static Runtime& Get();
  ~Runtime();

  // Handlers.  Throw dfccl::Error (the FFI boundary, ffi/error.h, converts it).
  // blocking: the blocking form, start and done in one call (one locked section,
  // the ready write and the done wait in one batch of stream memory operations).
  void Start(int ordinal, cudaStream_t stream, const CollectiveSpec& spec, const std::string& signature,
             const void* in, void* out, bool blocking);
  void Done(int ordinal, cudaStream_t stream, int64_t site);
  // The entries of jax_dfccl.config this runtime holds (module function config()).
  Config config();

  void Configure(const std::map<std::string, double>& kv);
  HostTimes& host_times() { return times_; }
  std::map<std::string, double> Stats(std::vector<std::string>* errors);
  std::vector<TraceOut> Trace();
  // Collectives in flight, per device and path (runtime/inspect.cc); tries the lock for wait_ms.
  std::string Pending(int wait_ms);
  void Reset();

 private:
  Runtime() = default;
  // What a handler enqueues on XLA's stream for one instance.
  struct Enqueue {
    Device* d = nullptr;
    uint64_t ticket = 0;  // without kCeTicket
    bool ce = false, kernel_wait = false, trace = false;
    TraceRec proto{};
  };
  std::unique_lock<std::timed_mutex> HandlerLock();
  uint64_t Submit(Device& d, const CollectiveSpec& spec, const std::string& sig, const void* in, void* out);
  Enqueue PlanWait(Device& d, uint64_t ticket);
  void EnqueueOnStream(cudaStream_t stream, const Enqueue& e, bool ready, bool wait);
  Device& GetDevice(int ordinal);
  Comm& GetComm(const std::vector<int64_t>& group);
  Instance* Join(Comm& c, const CollectiveSpec& spec, const std::string& sig, uint64_t seq, int64_t msg_bytes, bool ce);
  bool UseCopyEngine(const CollectiveSpec& spec, const Comm& c) const;
  void StartCopyEngine(Device& d, Comm& c, Instance& inst, const CollectiveSpec& spec, const void* in, void* out,
                       uint64_t ticket);
  template <size_t N>
  void PollRing(Device& d, std::array<TaskInfo, N>& info, uint64_t& oldest, uint64_t next,
                const volatile uint32_t* done, Clock::time_point now);
  void FillDesc(Device& d, uint64_t ticket, const CollectiveSpec& spec, const Comm& c, const Instance& inst,
                const void* in, void* out, int64_t msg_bytes);
  bool Running(Device& d);
  bool Alive(Device& d);
  void Launch(Device& d);
  void EnsureRunning(Device& d);
  void ProxyLoop();
  std::unique_lock<std::timed_mutex> ProxyLock();
  void PollDevice(Device& d, Clock::time_point now);
  void OnTaskDone(Device& d, TaskInfo& ti);
  void ReleaseSlot(Comm& c, Instance& inst);
  void Abort(Comm& c, Instance& inst, ErrorCode code, const std::string& why);
  void RecordError(const std::string& message);  // stats()["errors"]

  alignas(64) std::timed_mutex mu_;  // timed: the proxy and Pending() must not wait for it blindly
  std::atomic<double> timeout_s_{0.0};                 // cfg_.timeout_s (set by Configure), readable without mu_
  std::atomic<const char*> busy_in_{"nothing known"};  // a CUDA call made under mu_ that may block
  alignas(64) HostTimes times_;  // its own cache lines, not the lock's
  Config cfg_;
  std::map<int, std::unique_ptr<Device>> devices_;
  std::map<std::vector<int64_t>, std::unique_ptr<Comm>> comms_;
  std::unordered_map<uint64_t, std::string> key_names_;
  std::vector<std::string> errors_;
  std::thread proxy_;
  bool stop_ = false;
  CopyEngine ce_;
};

}  // namespace dfccl::gpu
