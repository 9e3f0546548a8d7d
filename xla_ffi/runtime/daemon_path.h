// The daemon path (every collective below the copy-engine sizes): the handlers
// do host work only at a call site's first call (Prepare: the site's static task
// and its sequence counter in device memory); every call after that is one
// kernel launch (device/submit_kernel.cu), and matching of (communicator,
// key_hash, seq) happens on the device (device/match.cuh), so the handlers are
// command-buffer compatible.  The host learns of submissions from the submit
// kernels' records (HostShared::sub, PollRecords); the proxy (proxy.h) polls the
// ticket ring, relaunches a daemon that quit and runs the watchdog, which calls
// back here to read an instance's match entry and to fail it.
//
// Owns: per device (PerDevice) the call sites, the (communicator, key) ->
// DeviceShared::seq_ctr index map and the daemon's ticket ring as the host sees
// it.  Lock: all of it under Context::mu; Submit and Finish run without it (they
// read only a Site, immutable once Prepare returned it, and Device's atomics),
// taking it only to (re)launch the daemon or to throw a recorded failure.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dfccl/collective.h"
#include "device/task.h"
#include "runtime/context.h"
#include "runtime/run_book.h"

namespace dfccl::gpu {

class Communicator;
class Proxy;

// The starts of one (communicator, key) on one device by execution (protocol "run"
// in device/task.h): the handlers of every call site of the key share it.
struct KeyRuns {
  std::mutex mu;
  RunBook book;
};

// One call site (a start op of a program) on one device: its static task, passed
// in every submit kernel's parameters (SubmitParams::task).
struct Site {
  int index = -1;
  Device* d = nullptr;
  Communicator* c = nullptr;
  std::string key, signature;
  uint64_t key_hash = 0;
  int rank = 0;
  int64_t msg_bytes = 0;
  bool large = false;
  bool ll = false;  // one lane of pool 0 (LL): the blocking form may run inline (config.tuning.submit_inline_us)
  InlineSubmitFn inline_kernel = nullptr;  // then its inline submit kernel (device/daemon.h)
  bool tagged = false;  // direct path across processes: its buffers are tagged with their ranges (runtime/ipc.h)
  bool identity = false;  // matched by identity in the staging (device/task.h, "identity")
  bool announce = false;  // a group spanning hosts: matched by announcements (device/task.h, "announce")
  uint32_t senders = 0;   // then the ranks whose message it receives (for the watchdog's message)
  TaskDesc desc{};        // the static task (protocol "site" in device/task.h)
  // A start form: its task uses the site's slots, never XLA's buffers (protocol
  // "staged" in device/task.h), so a program stopped before its done leaves nothing in use.
  bool staged = false;
  StageView stage{};
  int64_t in_bytes = 0, out_bytes = 0;
  // A group spanning processes: its key's execution book (protocol "run"); else null.
  KeyRuns* runs = nullptr;
};

class DaemonPath {
 public:
  static constexpr int kMaxOrdinals = 64;  // GPU ordinals the lock-free per-GPU arrays hold
  // The daemon path's state of one device.
  struct PerDevice {
    std::array<TaskInfo, kTaskRing> info;
    uint64_t seen = 0, oldest = 0;  // daemon tickets whose record the proxy read; the oldest pending
    std::vector<std::unique_ptr<Site>> sites;                 // by Site::index (the device's records name it)
    std::map<std::pair<Communicator*, uint64_t>, int> key_ctr;  // DeviceShared::seq_ctr index per (communicator, key)
  };

  DaemonPath(Context& ctx, Proxy& proxy) : ctx_(ctx), proxy_(proxy) {}
  // Handlers.  Throw dfccl::Error (the FFI boundary, ffi/error.h, converts it).
  // Prepare once per (call site, device) — under the lock, in relaxed
  // stream-capture mode, so it also works inside a command buffer's recording —,
  // then Submit (start; blocking: start and done in one kernel) and Finish (done)
  // launch one kernel each and touch no lock.
  // A start form's site is staged (`staged`: in_bytes, out_bytes are its buffers'
  // sizes); its Submit takes `init` (ragged_all_to_all's initial output, else null)
  // and Finish (every done belongs to a staged start) fills the done's `result` from the slot.
  // `run`: the execution's launch id (XLA's RunId; 0: none) — a start of a group spanning
  // processes counts itself in its program's line of the key's book on the device, which
  // submits the tombstones the line asks for first (protocol "run" in device/task.h).
  const Site* Prepare(int ordinal, const CollectiveSpec& spec, const std::string& signature, bool staged = false,
                      int64_t in_bytes = 0, int64_t out_bytes = 0);
  void Submit(cudaStream_t stream, const Site& site, const void* in, void* out, int64_t* ticket_out, bool blocking,
              uint32_t run, const void* init = nullptr);
  // The execution book of `key_hash` for the group `group` on GPU `ordinal` (protocol
  // "run"), which XLA's initialize stage of its starts fills; null for a group inside this
  // process.  No Context lock.
  KeyRuns* BookOf(int ordinal, const std::vector<int64_t>& group, uint64_t key_hash);
  // XLA's initialize stage of a start of the key in execution `run` (call site `site`):
  // the program's line on the device opened, its call sites written (runtime/run_book.h).
  void Plan(int ordinal, KeyRuns& kr, uint32_t run, int64_t site);
  // XLA's initialize stage of such a start: the execution's first on this GPU writes
  // its launch id into DeviceShared::run_word on `stream`, before the execution's
  // thunks (its captured starts read it there).
  void BeginExecution(int ordinal, cudaStream_t stream, uint32_t run);
  void Finish(int ordinal, cudaStream_t stream, const int64_t* ticket, const Site& staged, void* result);

  // Under Context::mu.
  PerDevice& Of(const Device& d) { return devices_[d.ordinal]; }
  void PollRecords(Device& d, Clock::time_point now);
  void OnDaemonTaskDone(Device& d, const TaskInfo& ti, uint32_t status);
  void AbortDaemonInstance(Communicator& c, uint64_t key_hash, uint64_t seq, ErrorCode code, const std::string& msg);
  void AbortTask(Device& d, uint64_t ticket);  // one task, no message (a tombstone)
  bool ReadEntry(Communicator& c, uint64_t key_hash, uint64_t seq, MatchEntry* out);
  uint32_t IdentityArrived(Device& d, const TaskInfo& ti, uint64_t ticket);
  int64_t tombstones() const { return tombstones_.load(); }  // seen in the records so far (no lock)

 private:
  TaskDesc SiteDesc(const CollectiveSpec& spec, const Communicator& c, int64_t msg_bytes, int key_ctr);
  template <class F>
  void Timed(Device& d, const char* what, F&& launch);
  static SubmitParams SiteParams(const Site& site, const KernelFlags& f);
  void WriteBook(int ordinal, size_t offset, const void* src, size_t bytes);  // into DeviceShared (no Context lock held)
  KeyRuns* RunsOf(int ordinal, const std::vector<int64_t>& group, uint64_t key_hash);  // takes runs_mu_

  Context& ctx_;
  Proxy& proxy_;
  std::map<int, PerDevice> devices_;  // by ordinal
  std::atomic<int64_t> tombstones_{0};
  std::mutex runs_mu_;  // runs_, slots_ (taken after a KeyRuns::mu, never before)
  std::map<std::tuple<int, std::vector<int64_t>, uint64_t>, std::unique_ptr<KeyRuns>> runs_;  // (ordinal, group, key)
  std::map<int, RunSlots> slots_;    // per ordinal: the free lines of DeviceShared::run_slot
  // Per ordinal: the launch id last written to run_word (read without a lock: XLA calls the
  // initialize stage once per start and execution, the first of them writes it).
  std::array<std::atomic<uint32_t>, kMaxOrdinals> begun_{};
  std::array<std::atomic<DeviceShared*>, kMaxOrdinals> dev_{};  // per ordinal, once set up (no lock after)
};

}  // namespace dfccl::gpu
