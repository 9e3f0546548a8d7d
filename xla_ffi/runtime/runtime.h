// The GPU host runtime: devices (daemon, queues), communicators (staging
// pools, match table), call sites, the proxy thread (completions, relaunch,
// watchdog).
//
// Daemon path (every collective below the copy-engine sizes): the handlers do
// host work only at a call site's first call (Prepare: the site's static task
// and its sequence counter in device memory); every call after that is one
// kernel launch (device/submit_kernel.cu), and matching of (communicator,
// key_hash, seq) happens on the device (device/match.cuh), so the handlers are
// command-buffer compatible.  The host learns of submissions from the submit
// kernels' records (HostShared::sub): the proxy relaunches a daemon that quit,
// reports failures and runs the watchdog.
//
// Copy-engine path (the *_host targets): matched on the host as before
// (Instance, Join), moved by the mover thread (runtime/copy_engine.h).
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
#include <set>
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
#include "runtime/ipc.h"

namespace dfccl::gpu {

using Clock = std::chrono::steady_clock;

struct Device;

// A copy-engine collective instance, matched on the host.
struct Instance {
  uint64_t key_hash = 0, seq = 0;
  std::string key, signature;
  int nranks = 0, done = 0;
  uint32_t started = 0;
  bool failed = false;
  std::vector<std::pair<Device*, uint64_t>> tasks;  // (device, ticket); kCeTicket marks the copy-engine ring
  std::vector<CeRank> ce_ranks;                     // per rank, filled as ranks start (copy-engine path)
};

static_assert(kMaxDaemonBlocks == kMaxBlocks, "config.h's block limit is the daemon's");
inline constexpr size_t kMaxErrors = 256;  // errors kept for stats()["errors"], newest last

inline constexpr uint64_t kCeTicket = uint64_t{1} << 63;  // tickets of the copy-engine ring carry this bit

struct Comm {
  std::vector<int> ordinals;  // per rank: the local CUDA ordinal, -1 for a device of another process
  int n = 0;
  bool direct = false;  // pool-1 instances take the direct path (Config::direct when created)
  CommDev view{};
  std::vector<CommDev*> dev_copy;           // per rank, on its device
  std::vector<std::pair<int, void*>> allocs;
  int64_t bytes = 0;
  std::map<std::pair<uint64_t, uint64_t>, std::unique_ptr<Instance>> live;
  std::map<std::pair<uint64_t, uint64_t>, std::unique_ptr<Instance>> failed;
  MatchTable* table = nullptr;  // daemon path: in rank 0's device memory (an IPC mapping in other processes)
  std::vector<int64_t> globals;  // the ranks' global device ids
  bool cross_process = false;    // some rank's device belongs to another process (CUDA IPC)
  bool ready = false;            // every rank's memory is in the view (cross-process: after ImportComm)
  int io_ordinal = 0;            // a local device, for reading the table
  std::vector<void*> opened;     // IPC mappings of the other processes' memory
  std::vector<int32_t> pids;     // per rank: its process's pid when it runs on this host (0: unknown)
  std::vector<std::string> procs;  // per rank of another process on the direct path: where its process listens (ipc.h)
  std::set<std::pair<uint64_t, uint64_t>> reported;  // daemon-path instances whose failure was reported
};

// One call site (a start op of a program) on one device: its static task, passed
// in every submit kernel's parameters (SubmitParams::task).
struct Site {
  int index = -1;
  Device* d = nullptr;
  struct Comm* c = nullptr;
  std::string key, signature;
  uint64_t key_hash = 0;
  int rank = 0;
  int64_t msg_bytes = 0;
  bool large = false;
  bool ll = false;  // one lane of pool 0 (LL): the blocking form may run inline (config.tuning.submit_inline_us)
  InlineSubmitFn inline_kernel = nullptr;  // then its inline submit kernel (device/daemon.h)
  bool tagged = false;  // direct path across processes: its buffers are tagged with their ranges (runtime/ipc.h)
  bool identity = false;  // matched by identity in the staging (device/task.h, "identity")
  uint32_t senders = 0;   // then the ranks whose message it receives (for the watchdog's message)
  TaskDesc desc{};        // the static task (protocol "site" in device/task.h)
  // A start form: its task uses the site's slots, never XLA's buffers (protocol
  // "staged" in device/task.h), so a program stopped before its done leaves nothing in use.
  bool staged = false;
  StageView stage{};
  int64_t in_bytes = 0, out_bytes = 0;
};

struct TaskInfo {
  Instance* inst = nullptr;  // copy-engine path
  const Site* site = nullptr;  // daemon path
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
  uint64_t seen = 0, oldest = 0, launches = 0;  // daemon tickets whose record the proxy read; the oldest pending
  uint64_t map_gen = 0;                         // DaemonParams::map_gen of the latest launch
  uint64_t blocks_launched = 0;                 // daemon blocks launched (pending(): against DeviceShared::blocks_left)
  // Written under the runtime lock; read without it by the submit handler's hot
  // path (Submit: is a daemon running, is it large enough), hence atomic.
  std::atomic<uint32_t> launch_id{0};
  std::atomic<int> workers{0};
  int pending_large = 0;
  std::atomic<bool> launched{false};
  Clock::time_point next_relaunch, next_peer_check;
  int64_t backoff_us = 20;
  std::array<TaskInfo, kTaskRing> info;
  std::array<TaskInfo, kCeRing> ce_info;  // copy-engine collectives (tickets ce_oldest .. ce_next)
  uint64_t ce_next = 0, ce_oldest = 0;
  std::map<std::pair<Comm*, uint64_t>, uint64_t> seq;       // copy-engine path: sequence numbers
  std::unordered_map<int64_t, std::deque<uint64_t>> fifo;  // copy-engine path: start/done pairing per site
  std::vector<std::unique_ptr<Site>> sites;                // daemon path, by Site::index (the device's records name it)
  std::map<std::pair<Comm*, uint64_t>, int> key_ctr;       // DeviceShared::seq_ctr index per (communicator, key)
  Status error;                                            // recorded by the proxy/watchdog; thrown by the next handler call
  std::atomic<bool> has_error{false};                      // error is set (read without the lock on the hot path)
  // A collective's failure (timeout, mismatch, a dead peer, an abort): thrown once,
  // then cleared — the failed instance stays behind as a tombstone (its match
  // entry failed, the host's failed map), so the device's next programs run.
  // Anything else (a CUDA error, a broken invariant) stays until reset().
  bool error_once = false;
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
  // Daemon path: Prepare once per (call site, device) — under the lock, in relaxed
  // stream-capture mode, so it also works inside a command buffer's recording —,
  // then Submit (start; blocking: start and done in one kernel) and Finish (done)
  // launch one kernel each and touch no lock.
  // A start form's site is staged (`staged`: in_bytes, out_bytes are its buffers'
  // sizes); its Submit takes `init` (ragged_all_to_all's initial output, else null)
  // and its Finish the done's `result`, filled from the slot.
  const Site* Prepare(int ordinal, const CollectiveSpec& spec, const std::string& signature, bool staged = false,
                      int64_t in_bytes = 0, int64_t out_bytes = 0);
  void Submit(cudaStream_t stream, const Site& site, const void* in, void* out, int64_t* ticket_out, bool blocking,
              const void* init = nullptr);
  void Finish(int ordinal, cudaStream_t stream, const int64_t* ticket, const Site* staged = nullptr,
              void* result = nullptr);
  // Copy-engine path (the *_host targets): matched on the host.
  void StartHost(int ordinal, cudaStream_t stream, const CollectiveSpec& spec, const std::string& signature,
                 const void* in, void* out, bool blocking);
  void DoneHost(int ordinal, cudaStream_t stream, int64_t site);
  // Across processes (jax_dfccl.initialize): global device id <-> local ordinal, and a
  // group's memory exchanged by CUDA IPC (Python moves the blobs through the KV store).
  void SetDeviceIds(const std::vector<std::pair<int64_t, int>>& ids);
  int64_t GlobalOf(int ordinal) const;
  std::string ExportComm(const std::vector<int64_t>& group, int rank);
  // The direct path across processes (runtime/ipc.h): this process listens at `name`
  // (jax_dfccl.initialize, once every local GPU's XLA memory was found exportable).
  void StartIpc(const std::string& name);
  static std::string CanExport(int ordinal, const void* p);
  void ImportComm(const std::vector<int64_t>& group, const std::vector<std::string>& blobs);
  // Whether a collective of these sizes takes the copy-engine path (Python picks the target at lowering).
  bool UsesCopyEngine(OpKind kind, int nranks, int64_t in_bytes, int64_t out_bytes);
  // The entries of jax_dfccl.config this runtime holds (module function config()).
  Config config();

  void Configure(const std::map<std::string, double>& kv);
  HostTimes& host_times() { return times_; }
  std::map<std::string, double> Stats(std::vector<std::string>* errors);
  std::vector<TraceOut> Trace();
  // Collectives in flight, per device and path (runtime/inspect.cc); tries the lock for wait_ms.
  std::string Pending(int wait_ms);
  void Reset();
  // Looks at every device's completions now and throws a recorded failure
  // (jax_dfccl.raise_if_failed: outside command buffers a failure otherwise
  // reaches Python at the device's next collective call).
  void RaiseIfFailed();

 private:
  Runtime() = default;
  // What a handler enqueues on XLA's stream for one instance.
  struct Enqueue {  // a copy-engine ticket's words on XLA's stream
    Device* d = nullptr;
    uint64_t ticket = 0;  // without kCeTicket
  };
  std::unique_lock<std::timed_mutex> HandlerLock();
  uint64_t SubmitCe(Device& d, const CollectiveSpec& spec, const std::string& sig, const void* in, void* out);
  void EnqueueOnStream(cudaStream_t stream, const Enqueue& e, bool ready, bool wait);
  Device& GetDevice(int ordinal);
  Device& GetDeviceFast(int ordinal);  // a device already set up (no lock)
  void InitTable(Comm& c);             // the match table empty, every slot free
  int OrdinalOf(int64_t global) const;  // -1: another process's device
  std::unique_ptr<Comm> NewComm(const std::vector<int64_t>& group, bool cross);
  void AllocRank(Comm& c, int r);
  void Publish(Comm& c);
  Comm& GetComm(const std::vector<int64_t>& group);
  Instance* Join(Comm& c, const CollectiveSpec& spec, const std::string& sig, uint64_t seq);
  bool UseCopyEngine(OpKind kind, int nranks, int64_t bytes) const;
  void ThrowIfFailed(Device& d);
  struct KernelFlags {
    int32_t trap, trace;
    int64_t timeout_ns;
  };
  KernelFlags FlagsFor(cudaStream_t stream);
  template <class F>
  void Timed(Device& d, const char* what, F&& launch);
  void PollRecords(Device& d, Clock::time_point now);
  void OnDaemonTaskDone(Device& d, const TaskInfo& ti, uint32_t status);
  void AbortDaemonInstance(Comm& c, uint64_t key_hash, uint64_t seq, ErrorCode code, const std::string& msg);
  bool ReadEntry(Comm& c, uint64_t key_hash, uint64_t seq, MatchEntry* out);
  uint32_t IdentityArrived(Device& d, const TaskInfo& ti, uint64_t ticket);
  std::string InstanceName(const Comm& c, const std::string& key, uint64_t seq) const;
  void CheckPeersAlive(Device& d, Clock::time_point now);
  void SetCommError(Comm& c, ErrorCode code, const std::string& msg);
  // Throws d.error (the caller holds the lock); a collective's failure is thrown once.
  [[noreturn]] void ThrowDeviceError(Device& d);
  void StartCopyEngine(Device& d, Comm& c, Instance& inst, const CollectiveSpec& spec, const void* in, void* out,
                       uint64_t ticket);
  template <size_t N>
  void PollRing(Device& d, std::array<TaskInfo, N>& info, uint64_t& oldest, uint64_t next,
                const volatile uint32_t* done, Clock::time_point now);
  TaskDesc SiteDesc(const CollectiveSpec& spec, const Comm& c, int64_t msg_bytes, int key_ctr);
  bool Running(Device& d);
  bool Alive(Device& d);
  void Launch(Device& d);
  void EnsureRunning(Device& d);
  void ProxyLoop();
  std::unique_lock<std::timed_mutex> ProxyLock();
  void PollDevice(Device& d, Clock::time_point now);
  void OnTaskDone(Device& d, TaskInfo& ti);
  void Abort(Comm& c, Instance& inst, ErrorCode code, const std::string& why);
  void RecordError(const std::string& message);  // stats()["errors"]

  alignas(64) std::timed_mutex mu_;  // timed: the proxy and Pending() must not wait for it blindly
  std::atomic<double> timeout_s_{0.0};                 // cfg_.timeout_s (set by Configure), readable without mu_
  std::atomic<bool> trace_{false};                     // cfg_.trace, readable without mu_
  std::atomic<int> large_workers_{0};                  // cfg_.large_workers(), readable without mu_
  std::atomic<int64_t> inline_ns_{0}, spin_ns_{0};     // cfg_.inline_ns(), cfg_.spin_ns(), readable without mu_
  std::atomic<int> sticky_max_{0};                     // cfg_.sticky_max(), readable without mu_
  std::atomic<bool> pdl_{false};                       // cfg_.submit_pdl, readable without mu_
  std::array<std::atomic<Device*>, 64> by_ordinal_{};  // devices_ for the lock-free done path
  std::atomic<const char*> busy_in_{"nothing known"};  // a CUDA call made under mu_ that may block
  alignas(64) HostTimes times_;  // its own cache lines, not the lock's
  Config cfg_;
  std::map<int, std::unique_ptr<Device>> devices_;
  std::map<std::vector<int64_t>, std::unique_ptr<Comm>> comms_;
  std::map<int64_t, int> ordinal_of_;  // empty in one process (ids are ordinals)
  std::map<int, int64_t> global_of_;
  std::unordered_map<uint64_t, std::string> key_names_;
  std::vector<std::string> errors_;
  std::thread proxy_;
  bool stop_ = false;
  CopyEngine ce_;
  Ipc ipc_;
};

}  // namespace dfccl::gpu
