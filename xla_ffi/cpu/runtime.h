// CPU backend runtime: communicators, collective instances, tasks.
//
// Roles (one process, N CPU devices, XLA runs each device's program on its own
// thread):
//   * the dfccl_start handler (producer, XLA's device thread) resolves the
//     instance (communicator, key_hash, seq), copies the rank's input into
//     runtime memory (Task::in_stage), posts it and its signature to the
//     instance, and submits a Task to the device's daemon; it never blocks.
//   * the device's daemon thread (consumer, daemon.cc) waits until every rank
//     posted, computes the rank's output by reading peers' staged inputs, and
//     reports "finished reading"; it preempts tasks that wait on peers.
//   * the dfccl_done handler hands the runtime its result buffer and waits
//     (asynchronously) until the Task completed; the output was computed into
//     that buffer, or into runtime memory (Task::out_stage) and is copied.
//     Nothing of XLA's that the runtime reads or writes after start returned
//     can be freed meanwhile, so an execution XLA abandons between start and
//     done (its buffers freed, its done never run) cannot be corrupted by its
//     peers or its daemon.
//
// Instance lifecycle (all transitions of `arrived`/`failed` happen under the
// communicator mutex, so "all ranks posted" and "failed" exclude each other):
//   open --(rank r posts; sig mismatch)--> failed
//   open --(timeout / reset, some rank missing)--> failed
//   open --(last rank posts)--> ready: slots are immutable from now on; every
//        rank's daemon reads peers' inputs, then readers_done += 1
//   ready --(readers_done == n)--> the thread that finished last completes
//        every rank's task (nobody reads any input any more: the inputs'
//        staging is released) and erases the instance.
//   failed: each posted task completes with the error at once (nobody ever
//        read anything); a late rank that arrives gets the same error; the
//        instance is erased once all n ranks arrived (or by reset()).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "cpu/config.h"
#include "cpu/staging.h"
#include "dfccl/check.h"
#include "dfccl/collective.h"

namespace dfccl::cpu {

class Daemon;
struct Task;
struct ShmRef;  // multiprocess.h

int64_t NowNs();  // steady_clock

// ---- configuration (configure(); cpu/config.h) ------------------------------
Config& GetConfig();

// ---- counters (stats()) ------------------------------------------------------
struct Counters {
  std::atomic<int64_t> started{0}, completed{0}, failed{0}, preemptions{0}, resumes{0};
  std::atomic<int64_t> live_tasks{0};  // gauge: started and not yet completed
};
Counters& GetCounters();

// Errors recorded (one per failed instance), newest last, at most kMaxErrors;
// stats()["errors"].  Cleared by Reset().
inline constexpr size_t kMaxErrors = 256;
void RecordError(const std::string& message);
std::vector<std::string> RecentErrors();

// ---- trace ring buffer -------------------------------------------------------
struct TraceRecord {
  int64_t device;
  std::string key;
  int64_t seq;
  const char* event;  // start, run, preempt, resume, finish, error
  int64_t t_ns;
};
void TraceEvent(int64_t device, const std::string& key, int64_t seq, const char* event);
std::vector<TraceRecord> TraceSnapshot();
int64_t TraceSize();

// ---- rendezvous objects ------------------------------------------------------

struct Slot {
  bool posted = false;
  const void* in = nullptr;
  std::string sig;
  std::shared_ptr<Task> task;  // cleared when the instance completes (breaks the cycle)
};

struct Instance {
  uint64_t key_hash = 0;
  int64_t seq = 0;
  std::string key;
  int n = 0;
  std::vector<Slot> slots;  // guarded by Communicator::mu until ready, then read-only
  int arrived = 0;          // guarded by Communicator::mu
  std::string error;        // guarded by Communicator::mu; set before `failed`
  ErrorCode error_kind = ErrorCode::kInternal;
  // Lock-free mirrors the daemons poll.  `posted` is stored (release) after the
  // slot was filled, so a daemon that loads n (acquire) sees every slot.
  std::atomic<int> posted{0};
  std::atomic<bool> failed{false};
  std::atomic<int> readers_done{0};
};

struct InstKey {
  uint64_t key_hash;
  int64_t seq;
  bool operator==(const InstKey& o) const { return key_hash == o.key_hash && seq == o.seq; }
};
struct InstKeyHash {
  size_t operator()(const InstKey& k) const {
    return std::hash<uint64_t>()(k.key_hash * 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(k.seq));
  }
};

// What remains of an instance that failed before every rank started it: the
// error, for a rank of the same execution that starts it late, and which ranks
// never did.  A rank that starts the key in a later execution (another XLA
// RunId) skips the sequence numbers it missed, so its counter meets its peers'
// again: a failed program leaves nothing that blocks or mismatches the next one.
struct Tombstone {
  std::string error;
  ErrorCode kind = ErrorCode::kInternal;
  std::vector<bool> missing;
};

// One per device group (keyed by CollectiveSpec::GroupName()).
struct Communicator {
  std::string name;
  std::vector<int64_t> devices;
  std::mutex mu;
  bool dead = false;  // reset() retired it; posts fail
  // key_hash -> per-rank count of starts (the next sequence number).
  std::unordered_map<uint64_t, std::vector<int64_t>> counters;
  // key_hash -> per-rank RunId of the execution that last started the key.
  std::unordered_map<uint64_t, std::vector<int64_t>> runs;
  std::unordered_map<InstKey, std::shared_ptr<Instance>, InstKeyHash> instances;
  // key_hash -> seq -> the failed instance's tombstone (while some missing rank has not moved past it).
  std::unordered_map<uint64_t, std::map<int64_t, Tombstone>> tombstones;
};

// One rank's part of one instance.
struct Task {
  CollectiveSpec spec;
  // XLA abandons an execution that fails between a start and its done (a host
  // callback raising, another collective failing) and frees its buffers at
  // once, while peers may still read this rank's input and the daemon write
  // its output; an asynchronous done that was called keeps its buffers until
  // it completes.  So the input lives in runtime memory: start copies it into
  // `in_stage` (a group spanning processes copies it into the shared arena
  // instead), released when the task completes (nobody reads it after that).
  // The output goes to done's result if done was called before the compute
  // (ComputeTarget), else into `out_stage`, which done copies; the caller's
  // initial output values, if any, are staged at start.  cpu/staging.h: pooled,
  // outside the heap.
  Staging in_stage, out_stage;
  const void* in = nullptr;  // in_stage, or the caller's input while a cross-process start copies it
  void* out = nullptr;       // where the compute wrote (ComputeTarget), read after completion
  std::atomic<void*> result{nullptr};  // done's result buffer (spec.out_bytes()), once done was called
  int64_t seq = 0;
  int64_t run = 0;  // launch id of the execution that started it (dfccl/execution.h)
  int64_t ticket = 0;
  int64_t start_ns = 0;
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Instance> inst;
  Daemon* daemon = nullptr;
  // Set for a group spanning processes (multiprocess.h): the shared instance;
  // `inst` is then a local shell (n, key, seq) and never becomes ready.
  std::shared_ptr<ShmRef> shm;

  // Scheduling state, touched only by the owning daemon thread.
  bool preempted = false, sticky = false;
  int last_posted = -1;

  // Who computes this rank's output once the instance is ready: the daemon or,
  // when the instance is already ready as done() is called, XLA's device thread
  // inside done() (saves a thread wake-up).  The first to flip `claimed`
  // computes; the other does nothing.
  std::atomic<bool> claimed{false};

  // Completion: `done` flips once (under mu); AbortDevice waits on cv.
  std::atomic<bool> done{false};
  std::mutex mu;
  std::condition_variable cv;
  ErrorCode err_kind = ErrorCode::kOk;
  std::string error;
  // Set by WaitCollectiveAsync while the task is pending (under mu); run once,
  // on the completion thread, after the task completed.
  std::function<void()> on_complete;

  // First call wins; runs on_complete (on the completion thread); counts and traces.
  void Complete(ErrorCode kind, std::string message);
  // The instance became ready: wake the daemon that computes this rank.
  void NotifyReady();
  // Computes (and releases) if nobody claimed it yet; returns whether it did.
  bool TryCompute();
  // Every rank posted (acquire): the task can be computed.
  bool Ready() const;
  // Where the one computing thread writes the output (sets `out`): done's
  // result when done was called and nothing is staged, else `out_stage`.
  void* ComputeTarget();
};

// ---- entry points --------------------------------------------------------------
// dfccl_start: returns the ticket.  `in` (spec.in_bytes()) is copied before it
// returns; `init` (spec.out_bytes(), or null) holds the output's initial values
// for an op that keeps some of them (ragged_all_to_all).  `run_id` identifies
// the XLA execution (equal on every device of one run; see Tombstone).  Throws
// dfccl::Error on malformed input.
int64_t StartCollective(const CollectiveSpec& spec, const void* in, const void* init = nullptr,
                        int64_t run_id = 0);
// Makes a started task reachable by its ticket (for done()).
void RegisterTicket(const std::shared_ptr<Task>& task);

// dfccl_done: blocks until the ticket's task completed.
// (the runtime's errors are dfccl::Error when thrown, dfccl::Status as values: dfccl/check.h)
using DoneStatus = ::dfccl::Status;
// dfccl_done, asynchronously: `callback` runs once the ticket's task completed
// (at once, on the caller's thread, if it already has; else on the device's
// completion thread, never on a daemon).  XLA's device thread is never blocked, so a
// device whose executor reaches done(A) before start(B) still starts B.
// After an error the device's other pending collectives are failed first.
// On success the output is in `result` (`result_bytes`, which must be
// spec.out_bytes()) before `callback` runs: computed there (the compute may
// write it from this call on) or copied from the task's staging.
void WaitCollectiveAsync(int64_t ticket, std::string_view key, void* result, int64_t result_bytes,
                         std::function<void(const DoneStatus&)> callback);
// The same, blocking (C++ tests).
DoneStatus WaitCollective(int64_t ticket, std::string_view key, void* result, int64_t result_bytes);

// Once inst->posted == n, by whoever claimed the task: computes this rank's
// output and reports finished reading (completing the instance if last).
void ComputeAndRelease(Task& task);

// Called by a daemon when the task waited on peers longer than timeout_s.
void FailOnTimeout(Task& task, double timeout_s);

// Module functions.
struct StatsSnapshot {
  int64_t started, completed, failed, preemptions, resumes, pending, daemon_threads,
      communicators, instances_live, key_counters, trace_records, tickets, tombstones, staging_bytes,
      staging_pool_bytes;
};
StatsSnapshot GetStats();
// One line per collective instance in flight: key, sequence, which ranks started
// it and which did not, how long ago the first one did ("" if none).
std::string PendingReport();
void Reset();

}  // namespace dfccl::cpu
