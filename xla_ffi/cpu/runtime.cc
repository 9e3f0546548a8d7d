// CPU backend runtime: see runtime.h for the roles and the instance lifecycle.
//
// Lock order: Globals::comms_mu -> Communicator::mu (never the reverse); no
// lock is held while calling Task::Complete or Daemon::Wake/Submit.
#include "cpu/runtime.h"
#include "dfccl/host.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>
#include <utility>

#include "cpu/daemon.h"
#include "cpu/globals.h"
#include "cpu/collectives.h"
#include "cpu/multiprocess.h"
#include <deque>
#include <future>
#include <functional>
#include "dfccl/check.h"

namespace dfccl::cpu {
namespace {

// Detaches the posted ranks' tasks from a failing/finishing instance.
// Caller holds the communicator mutex.
std::vector<std::shared_ptr<Task>> TakeTasks(Instance& inst) {
  std::vector<std::shared_ptr<Task>> tasks;
  for (Slot& s : inst.slots)
    if (s.task) tasks.push_back(std::move(s.task));
  return tasks;
}

// Marks an open instance failed.  Caller holds the communicator mutex and has
// checked arrived < n (so no rank has read, or will ever read, a peer input).
std::vector<std::shared_ptr<Task>> FailLocked(Instance& inst, ErrorCode kind, std::string msg) {
  RecordError(msg);
  inst.error = std::move(msg);
  inst.error_kind = kind;
  inst.failed.store(true, std::memory_order_release);
  return TakeTasks(inst);
}

void EraseIfCurrent(Communicator& comm, const Instance& inst) {
  auto it = comm.instances.find(InstKey{inst.key_hash, inst.seq});
  if (it != comm.instances.end() && it->second.get() == &inst) comm.instances.erase(it);
}

// A failed instance leaves the table at once; the ranks that never started it
// find its tombstone instead.  Caller holds the communicator mutex.
void Bury(Communicator& comm, const Instance& inst) {
  Tombstone t{inst.error, inst.error_kind, std::vector<bool>(inst.n)};
  bool any = false;
  for (int r = 0; r < inst.n; ++r) any |= (t.missing[r] = !inst.slots[r].posted);
  if (any) comm.tombstones[inst.key_hash][inst.seq] = std::move(t);
  EraseIfCurrent(comm, inst);
}

// Rank `rank` no longer misses tombstone `it` of a key; forgets it once no rank does.
// Returns the next tombstone of the key.
using Tombstones = std::map<int64_t, Tombstone>;
Tombstones::iterator Unmiss(Tombstones& per_key, Tombstones::iterator it, int rank) {
  it->second.missing[rank] = false;
  for (bool m : it->second.missing)
    if (m) return std::next(it);
  return per_key.erase(it);
}

// Fault injection: sleeps `us` microseconds (0: nothing).
void FaultDelay(double us) {
  if (us > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(static_cast<int64_t>(us * 1e3)));
}

}  // namespace

Globals& G() {
  static Globals* g = new Globals;
  return *g;
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Config& GetConfig() { return G().config; }
Counters& GetCounters() { return G().counters; }

// ---- completion threads -------------------------------------------------------------
// Run the callbacks of asynchronous dones, off the daemons: a callback
// completes XLA's future, and XLA may continue the device's program inline.
class Completer {
 public:
  void Post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> l(mu_);
      queue_.push_back(std::move(f));
      if (!started_) {
        started_ = true;
        std::thread([this] {
          NameThisThread("dfccl-done");
          Loop();
        }).detach();
      }
    }
    cv_.notify_one();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return !queue_.empty(); });
      std::function<void()> f = std::move(queue_.front());
      queue_.pop_front();
      l.unlock();
      f();
      l.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool started_ = false;
};

// One completion thread per device: XLA may run the device's program on from
// the completing thread, up to a blocking point of its own (e.g. one of XLA's
// CPU collectives); a shared thread would then stall every other device.
void PostCompletion(int64_t device, std::function<void()> f) {
  static std::mutex mu;
  static auto* completers = new std::unordered_map<int64_t, Completer*>();  // leaked
  Completer* c;
  {
    std::lock_guard<std::mutex> l(mu);
    Completer*& slot = (*completers)[device];
    if (!slot) slot = new Completer();
    c = slot;
  }
  c->Post(std::move(f));
}

// ---- task completion -------------------------------------------------------------
void Task::Complete(ErrorCode kind, std::string message) {
  Counters& c = G().counters;
  {
    std::lock_guard<std::mutex> l(mu);
    if (done.load(std::memory_order_relaxed)) return;
    err_kind = kind;
    error = std::move(message);
    // Counted before `done` is visible: stats() read after done()
    // returned include this task.
    (kind == ErrorCode::kOk ? c.completed : c.failed).fetch_add(1, std::memory_order_relaxed);
    c.live_tasks.fetch_sub(1, std::memory_order_relaxed);
    done.store(true, std::memory_order_release);
    // Every reader of this rank's input finished (or none ever started).
    in_stage.reset();
  }
  // AbortDevice holds a shared_ptr to this task and so does our caller, so the
  // task outlives this notify.
  cv.notify_all();
  std::function<void()> cb;
  {
    std::lock_guard<std::mutex> l(mu);
    cb = std::move(on_complete);
  }
  if (cb) PostCompletion(spec.self_device, std::move(cb));
  TraceEvent(spec.self_device, spec.key, seq, kind == ErrorCode::kOk ? "finish" : "error");
  // The owning daemon is not woken: it drops the task at its next poll.
}

void Task::NotifyReady() { daemon->Wake(); }

bool Task::Ready() const {
  return shm ? ShmReady(*this) : inst->posted.load(std::memory_order_acquire) == inst->n;
}

void* Task::ComputeTarget() {
  void* r = result.load(std::memory_order_acquire);
  if (r != nullptr && out_stage.data() == nullptr) return out = r;
  if (out_stage.data() == nullptr) out_stage = Staging(spec.out_bytes());
  return out = out_stage.data();
}

bool Task::TryCompute() {
  if (claimed.load(std::memory_order_relaxed) || claimed.exchange(true, std::memory_order_acq_rel)) return false;
  ComputeAndRelease(*this);
  return true;
}

// ---- start ---------------------------------------------------------------------
void RegisterTicket(const std::shared_ptr<Task>& task) {
  Globals& g = G();
  std::lock_guard<std::mutex> l(g.tickets_mu);
  g.tickets.emplace(task->ticket, task);
}

int64_t StartCollective(const CollectiveSpec& spec, const void* in, const void* init, int64_t run_id) {
  Globals& g = G();
  DFCCL_CHECK_CODE(g.config.configured.load(std::memory_order_acquire), ErrorCode::kFailedPrecondition,
                   "dfccl: the CPU runtime was not configured (jax_dfccl._src.backend.load() passes every "
                   "entry of jax_dfccl.config to it)");
  // Fault injection (tests; config.fault_*): this device's starts come late.
  if (g.config.fault_device.load(std::memory_order_relaxed) == spec.self_device)
    FaultDelay(g.config.fault_start_delay_us.load(std::memory_order_relaxed));
  const int n = spec.nranks;
  DFCCL_CHECK(n >= 1 && spec.rank >= 0 && spec.rank < n && static_cast<int>(spec.group_devices.size()) == n,
              "dfccl: collective '" << spec.key << "': bad group (rank " << spec.rank << " of " << n << ")");
  std::shared_ptr<Communicator> comm;
  {
    std::string name = spec.GroupName();
    std::lock_guard<std::mutex> l(g.comms_mu);
    auto& c = g.comms[name];
    if (!c) {
      c = std::make_shared<Communicator>();
      c->name = std::move(name);
      c->devices = spec.group_devices;
    }
    comm = c;
  }
  auto task = std::make_shared<Task>();
  task->spec = spec;
  // The input in runtime memory (Task::in_stage); the output is staged now only
  // when it starts from the caller's values (else at the compute, if needed).
  if (init != nullptr && spec.out_bytes() > 0) {
    task->out_stage = Staging(spec.out_bytes());
    std::memcpy(task->out_stage.data(), init, spec.out_bytes());
  }
  if (CrossProcess(spec) || spec.in_bytes() == 0) {
    task->in = in;  // copied into the shared arena before StartCrossProcess returns
  } else {
    task->in_stage = Staging(spec.in_bytes());
    std::memcpy(task->in_stage.data(), in, spec.in_bytes());
    task->in = task->in_stage.data();
  }
  task->comm = comm;
  task->daemon = &DaemonFor(spec.self_device);
  task->start_ns = NowNs();
  task->run = run_id;
  task->ticket = g.next_ticket.fetch_add(1, std::memory_order_relaxed);
  g.counters.started.fetch_add(1, std::memory_order_relaxed);
  g.counters.live_tasks.fetch_add(1, std::memory_order_relaxed);
  if (CrossProcess(spec)) return StartCrossProcess(task);

  // Post under the communicator mutex; act (complete / wake) after releasing it.
  std::vector<std::shared_ptr<Task>> fail_tasks;
  ErrorCode fail_kind = ErrorCode::kInternal;
  std::string fail_msg;
  std::vector<std::shared_ptr<Task>> ready;  // every rank's task, when we posted last
  {
    std::lock_guard<std::mutex> l(comm->mu);
    auto& cnt = comm->counters[spec.key_hash];
    if (cnt.empty()) cnt.assign(n, 0);
    auto& runs = comm->runs[spec.key_hash];
    if (runs.empty()) runs.assign(n, run_id);
    auto tk = comm->tombstones.find(spec.key_hash);
    if (runs[spec.rank] != run_id) {
      // A new execution on this rank: skip the instances that failed without it in an earlier one.
      runs[spec.rank] = run_id;
      if (tk != comm->tombstones.end()) {
        Tombstones& per_key = tk->second;
        for (auto it = per_key.begin(); it != per_key.end();) {
          if (it->first >= cnt[spec.rank] && it->second.missing[spec.rank]) {
            cnt[spec.rank] = it->first + 1;
            it = Unmiss(per_key, it, spec.rank);
          } else {
            ++it;
          }
        }
        if (per_key.empty()) {
          comm->tombstones.erase(tk);
          tk = comm->tombstones.end();
        }
      }
    }
    task->seq = cnt[spec.rank]++;
    TraceEvent(spec.self_device, spec.key, task->seq, "start");  // before any peer can run it
    auto& slot_inst = comm->instances[InstKey{spec.key_hash, task->seq}];
    if (!slot_inst) {
      slot_inst = std::make_shared<Instance>();
      slot_inst->key_hash = spec.key_hash;
      slot_inst->seq = task->seq;
      slot_inst->key = spec.key;
      slot_inst->n = n;
      slot_inst->slots.resize(n);
    }
    std::shared_ptr<Instance> inst = slot_inst;
    task->inst = inst;
    ++inst->arrived;
    Tombstones::iterator tomb;
    const bool buried = tk != comm->tombstones.end() && (tomb = tk->second.find(task->seq)) != tk->second.end() &&
                        tomb->second.missing[spec.rank];
    if (buried) {
      // Late arrival, in the same execution, at an instance that failed without it: the same error.
      fail_tasks = {task};
      fail_kind = tomb->second.kind;
      fail_msg = tomb->second.error;
      Unmiss(tk->second, tomb, spec.rank);
      if (tk->second.empty()) comm->tombstones.erase(tk);
      if (inst->arrived == 1) EraseIfCurrent(*comm, *inst);  // created just now for this lookup
    } else if (comm->dead) {
      fail_tasks = {task};
      fail_msg = "dfccl: collective '" + spec.key + "': the runtime was reset while it started";
    } else if (inst->failed.load(std::memory_order_relaxed)) {
      // Late arrival at a failed instance: same error, nothing was read.
      fail_tasks = {task};
      fail_kind = inst->error_kind;
      fail_msg = inst->error;
      if (inst->arrived == n) EraseIfCurrent(*comm, *inst);
    } else {
      std::string sig = spec.Signature();
      int other = -1;
      for (int r = 0; r < n && other < 0; ++r)
        if (inst->slots[r].posted && inst->slots[r].sig != sig) other = r;
      if (other >= 0) {
        const int lo = std::min(other, spec.rank), hi = std::max(other, spec.rank);
        const std::string& lo_sig = lo == spec.rank ? sig : inst->slots[lo].sig;
        const std::string& hi_sig = hi == spec.rank ? sig : inst->slots[hi].sig;
        std::ostringstream os;
        os << "dfccl: collective '" << spec.key << "' (seq " << task->seq << ") mismatch: rank " << lo << " "
           << lo_sig << " vs rank " << hi << " " << hi_sig;
        fail_kind = ErrorCode::kFailedPrecondition;
        fail_msg = os.str();
        fail_tasks = FailLocked(*inst, fail_kind, fail_msg);
        fail_tasks.push_back(task);
        inst->slots[spec.rank].posted = true;  // this rank did start it: no tombstone entry for it
        Bury(*comm, *inst);
      } else {
        Slot& s = inst->slots[spec.rank];
        s.posted = true;
        s.in = task->in;
        s.sig = std::move(sig);
        s.task = task;
        // Publishes the slot to daemons polling `posted` without the mutex.
        inst->posted.store(inst->arrived, std::memory_order_release);
        if (inst->arrived == n)
          for (Slot& p : inst->slots) ready.push_back(p.task);
      }
    }
  }
  {
    std::lock_guard<std::mutex> l(g.tickets_mu);
    g.tickets.emplace(task->ticket, task);
  }
  const bool failing_now = !fail_tasks.empty();
  // A task whose peers have not all posted needs its daemon only to watch the
  // timeout: Submit wakes it then only from a deep sleep.  "All posted" wakes,
  // for every rank, the daemon that will compute it (unless done() does).
  if (!failing_now) task->daemon->Submit(task, /*urgent=*/!ready.empty());
  for (auto& t : fail_tasks) t->Complete(fail_kind, fail_msg);
  for (auto& t : ready)
    if (t != task) t->NotifyReady();
  return task->ticket;
}

// ---- daemon-side transitions -----------------------------------------------------
void ComputeAndRelease(Task& t) {
  // Fault injection (tests; config.fault_*): this device computes slowly.
  if (GetConfig().fault_device.load(std::memory_order_relaxed) == t.spec.self_device)
    FaultDelay(GetConfig().fault_compute_delay_us.load(std::memory_order_relaxed));
  if (t.shm) return ShmComputeAndRelease(t);
  Instance& inst = *t.inst;
  // The instance is ready (posted == n was loaded with acquire): slots are
  // immutable and every peer input stays valid until all readers are done,
  // because no rank's task completes before readers_done == n.
  TraceEvent(t.spec.self_device, t.spec.key, t.seq, "run");  // start [preempt resume]* run finish
  std::vector<const void*> ins(inst.n);
  for (int r = 0; r < inst.n; ++r) ins[r] = inst.slots[r].in;
  const Status computed = ExecuteCollectiveStatus(t.spec, ins, [&t] { return t.ComputeTarget(); });
  const ErrorCode kind = computed.code;
  const std::string& msg = computed.message;
  if (kind != ErrorCode::kOk) {
    // A ready instance never carries a failure error, so `error` is free to
    // hold the first compute error; recorded before our readers_done increment.
    std::lock_guard<std::mutex> l(t.comm->mu);
    if (inst.error.empty()) { inst.error = msg; inst.error_kind = kind; RecordError(msg); }
  }
  // The task may not complete yet: peers may still be reading our input.
  // acq_rel: the last reader sees every rank's output writes.
  if (inst.readers_done.fetch_add(1, std::memory_order_acq_rel) + 1 < inst.n) return;
  // Last reader: nobody reads any input any more; complete every rank (an
  // error of any rank fails them all) and forget the instance.
  std::vector<std::shared_ptr<Task>> tasks;
  std::string err;
  ErrorCode err_kind = ErrorCode::kOk;
  {
    std::lock_guard<std::mutex> l(t.comm->mu);
    if (!inst.error.empty()) { err = inst.error; err_kind = inst.error_kind; }
    tasks = TakeTasks(inst);
    EraseIfCurrent(*t.comm, inst);
  }
  for (auto& p : tasks) p->Complete(err_kind, err);
}

void FailOnTimeout(Task& t, double timeout_s) {
  if (t.shm) return ShmFailOnTimeout(t, timeout_s);
  Instance& inst = *t.inst;
  std::vector<std::shared_ptr<Task>> tasks;
  std::string msg;
  {
    std::lock_guard<std::mutex> l(t.comm->mu);
    if (inst.failed.load(std::memory_order_relaxed) || inst.arrived == inst.n) return;  // lost a race
    std::ostringstream os;
    os << "dfccl: collective '" << inst.key << "' (seq " << inst.seq << ") timed out after " << timeout_s
       << " s on rank " << t.spec.rank << ": ranks [";
    bool first = true;
    for (int r = 0; r < inst.n; ++r) {
      if (inst.slots[r].posted) continue;
      os << (first ? "" : ", ") << r << " (device " << t.comm->devices[r] << ")";
      first = false;
    }
    os << "] never started it";
    msg = os.str();
    tasks = FailLocked(inst, ErrorCode::kDeadlineExceeded, msg);
    Bury(*t.comm, inst);
  }
  for (auto& p : tasks) p->Complete(ErrorCode::kDeadlineExceeded, msg);
}

// ---- device abort ----------------------------------------------------------------
// A handler error ends the device's program: XLA skips its remaining thunks and
// frees its buffers, so the device's other started collectives will never see
// their done().  Their inputs/outputs must not be touched after that:
//   * an open instance fails now on every rank (peers get an error at once
//     instead of a timeout, and nobody will ever read or write those buffers);
//   * a ready instance is being computed: wait until it completed (finite: all
//     ranks posted and no compute blocks) before the error is returned to XLA.
namespace {
void AbortDevice(int64_t device, const std::string& failed_key) {
  Globals& g = G();
  std::vector<std::shared_ptr<Task>> victims;
  {
    std::lock_guard<std::mutex> l(g.tickets_mu);
    for (auto& [ticket, t] : g.tickets)
      if (t->spec.self_device == device && !t->done.load(std::memory_order_acquire)) victims.push_back(t);
  }
  for (auto& v : victims) {
    if (v->shm) {
      ShmAbort(*v, failed_key);
      std::unique_lock<std::mutex> l(v->mu);
      v->cv.wait(l, [&] { return v->done.load(std::memory_order_relaxed); });
      continue;
    }
    Instance& inst = *v->inst;
    std::vector<std::shared_ptr<Task>> tasks;
    std::string msg;
    {
      std::lock_guard<std::mutex> l(v->comm->mu);
      if (!inst.failed.load(std::memory_order_relaxed) && inst.arrived < inst.n) {
        msg = "dfccl: collective '" + inst.key + "' (seq " + std::to_string(inst.seq) + ") failed: rank " +
              std::to_string(v->spec.rank) + " (device " + std::to_string(device) +
              ") stopped after an error in collective '" + failed_key + "'";
        tasks = FailLocked(inst, ErrorCode::kAborted, msg);
        Bury(*v->comm, inst);
      }
    }
    for (auto& p : tasks) p->Complete(ErrorCode::kAborted, msg);
    std::unique_lock<std::mutex> l(v->mu);
    v->cv.wait(l, [&] { return v->done.load(std::memory_order_relaxed); });
  }
}
}  // namespace

// ---- done ----------------------------------------------------------------------
void WaitCollectiveAsync(int64_t ticket, std::string_view key, void* result, int64_t result_bytes,
                         std::function<void(const DoneStatus&)> callback) {
  Globals& g = G();
  std::shared_ptr<Task> t;
  {
    std::lock_guard<std::mutex> l(g.tickets_mu);
    auto it = g.tickets.find(ticket);
    if (it == g.tickets.end())
      return callback({ErrorCode::kFailedPrecondition, "dfccl: collective '" + std::string(key) +
                                                   "': handle done twice or never started (ticket " +
                                                   std::to_string(ticket) + ")"});
    if (it->second->spec.key != key)
      return callback({ErrorCode::kFailedPrecondition, "dfccl: done of collective '" + std::string(key) +
                                                   "' was given the handle of '" + it->second->spec.key + "'"});
    t = std::move(it->second);
    g.tickets.erase(it);
  }
  // XLA keeps `result` until this done completes: the compute may write it directly.
  if (result_bytes > 0 && result_bytes == t->spec.out_bytes()) t->result.store(result, std::memory_order_release);
  // The last reader (or a failure) completes the task; the daemon computes this
  // rank's output and enforces the timeout, unless the instance is ready now
  // and the daemon has not claimed it: then this thread computes it.
  if (!t->done.load(std::memory_order_acquire) && !t->claimed.load(std::memory_order_acquire) && t->Ready())
    t->TryCompute();
  auto finish = [t, result, result_bytes, callback = std::move(callback)] {
    DoneStatus st{t->err_kind, t->error};
    if (st.ok() && result_bytes != t->spec.out_bytes())
      st = {ErrorCode::kInternal, "dfccl: collective '" + t->spec.key + "' (rank " +
                                      std::to_string(t->spec.rank) + "): done's result holds " +
                                      std::to_string(result_bytes) + " bytes, the collective's output " +
                                      std::to_string(t->spec.out_bytes())};
    if (st.ok() && result_bytes > 0 && t->out != result) std::memcpy(result, t->out, result_bytes);
    if (st.code != ErrorCode::kOk) AbortDevice(t->spec.self_device, t->spec.key);
    callback(st);
  };
  {
    std::lock_guard<std::mutex> l(t->mu);
    if (!t->done.load(std::memory_order_relaxed)) {
      t->on_complete = std::move(finish);
      return;
    }
  }
  finish();
}

DoneStatus WaitCollective(int64_t ticket, std::string_view key, void* result, int64_t result_bytes) {
  std::promise<DoneStatus> p;
  std::future<DoneStatus> f = p.get_future();
  WaitCollectiveAsync(ticket, key, result, result_bytes, [&p](const DoneStatus& st) { p.set_value(st); });
  return f.get();
}

void Reset() {
  Globals& g = G();
  ShmReset();  // fails this process's open shared instances (peers get the error)
  std::vector<std::shared_ptr<Communicator>> comms;
  {
    std::lock_guard<std::mutex> l(g.comms_mu);
    for (auto& [name, c] : g.comms) comms.push_back(c);
    g.comms.clear();  // the next start creates fresh communicators and counters
  }
  std::vector<std::pair<std::shared_ptr<Task>, std::string>> to_fail;
  for (auto& c : comms) {
    std::lock_guard<std::mutex> l(c->mu);
    c->dead = true;
    for (auto& [k, inst] : c->instances) {
      // Ready instances are being computed and complete on their own (their
      // inputs are being read: never fail them).  Open ones fail now.
      if (inst->failed.load(std::memory_order_relaxed) || inst->arrived == inst->n) continue;
      std::string msg = "dfccl: collective '" + inst->key + "' (seq " + std::to_string(inst->seq) +
                        ") aborted by reset()";
      for (auto& t : FailLocked(*inst, ErrorCode::kAborted, msg)) to_fail.emplace_back(std::move(t), msg);
    }
    c->instances.clear();
    c->counters.clear();
    c->runs.clear();
    c->tombstones.clear();
  }
  for (auto& [t, msg] : to_fail) t->Complete(ErrorCode::kAborted, msg);
  {
    // Handles whose done will never come (a test gave up after a fault).
    std::lock_guard<std::mutex> l(g.tickets_mu);
    for (auto it = g.tickets.begin(); it != g.tickets.end();)
      it = it->second->done.load() ? g.tickets.erase(it) : std::next(it);
  }
  {
    std::lock_guard<std::mutex> l(g.trace_mu);
    g.ring.clear();
    g.ring_head = 0;
  }
  {
    std::lock_guard<std::mutex> l(g.errors_mu);
    g.errors.clear();
  }
  TrimStaging();  // (the tasks of abandoned executions were dropped with their tickets above)
  for (auto* c : {&g.counters.started, &g.counters.completed, &g.counters.failed, &g.counters.preemptions,
                  &g.counters.resumes})
    c->store(0);
}

}  // namespace dfccl::cpu
