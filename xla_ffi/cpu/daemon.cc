// Daemon thread per CPU device: scheduler over pending tasks with preemption
// and sticky spin budgets (see daemon.h).
#include "cpu/daemon.h"
#include "dfccl/host.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <unordered_map>

#include "cpu/multiprocess.h"
#include "cpu/runtime.h"

namespace dfccl::cpu {
namespace {

struct DaemonRegistry {
  std::mutex mu;
  std::unordered_map<int64_t, Daemon*> daemons;
};

// Leaked with the daemons (see DaemonFor).
DaemonRegistry& Registry() {
  static DaemonRegistry* r = new DaemonRegistry;
  return *r;
}

constexpr int kYieldRounds = 3;           // idle rounds before sleeping
constexpr int64_t kMinBackoffUs = 50;     // first sleep
constexpr int64_t kMaxBackoffUs = 1000;   // sleeps double up to this
constexpr int64_t kIdlePollUs = 2000;     // poll period with no pending task ...
constexpr int kIdlePolls = 25;            // ... for this many periods, then deep sleep

}  // namespace

Daemon& DaemonFor(int64_t device) {
  DaemonRegistry& r = Registry();
  std::lock_guard<std::mutex> l(r.mu);
  Daemon*& d = r.daemons[device];
  if (!d) d = new Daemon(device);  // never deleted: its thread is detached
  return *d;
}

int64_t NumDaemons() {
  DaemonRegistry& r = Registry();
  std::lock_guard<std::mutex> l(r.mu);
  return static_cast<int64_t>(r.daemons.size());
}

void WakeAllDaemons() {
  std::vector<Daemon*> all;
  {
    DaemonRegistry& r = Registry();
    std::lock_guard<std::mutex> l(r.mu);
    for (auto& [d, daemon] : r.daemons) all.push_back(daemon);
  }
  for (Daemon* d : all) d->Wake();
}

Daemon::Daemon(int64_t device) : device_(device) {
  std::thread([this] {
    NameThisThread("dfccl-daemon");
    Loop();
  }).detach();
}

void Daemon::Submit(std::shared_ptr<Task> task, bool urgent) {
  bool notify;
  {
    std::lock_guard<std::mutex> l(mu_);
    inbox_.push_back(std::move(task));
    ++epoch_;
    notify = urgent || deep_sleep_;
  }
  if (notify) cv_.notify_one();
}

void Daemon::Wake() {
  {
    std::lock_guard<std::mutex> l(mu_);
    ++epoch_;
  }
  cv_.notify_one();
}

// Wake-up protocol: the daemon snapshots epoch_ (under mu_) before a round and
// sleeps afterwards only if epoch_ is unchanged, both re-checked under mu_.
// Producers change epoch_ under mu_ before notifying, so an urgent event during
// the round is never lost.  Non-urgent submissions are picked up by the timed
// polls (they bound the latency of timeouts only); deep_sleep_ is set under mu_
// before the untimed wait, so a submission then always notifies.
void Daemon::Loop() {
  int idle_rounds = 0;
  int64_t backoff_us = kMinBackoffUs;
  for (;;) {
    uint64_t seen;
    {
      std::unique_lock<std::mutex> l(mu_);
      // Nothing pending: poll the inbox for a while, then sleep until notified.
      for (int polls = 0; pending_.empty() && inbox_.empty(); ++polls) {
        if (polls < kIdlePolls) {
          cv_.wait_for(l, std::chrono::microseconds(kIdlePollUs));
        } else {
          deep_sleep_ = true;
          cv_.wait(l, [&] { return !inbox_.empty(); });
          deep_sleep_ = false;
        }
      }
      seen = epoch_;
      for (auto& t : inbox_) pending_.push_back(std::move(t));
      inbox_.clear();
    }
    // A done task needs nothing more from us: it completed either after every
    // rank finished reading or failed before anyone started reading.
    auto drop_done = [&] {
      const size_t before = pending_.size();
      std::erase_if(pending_, [](const std::shared_ptr<Task>& t) { return t->done.load(std::memory_order_acquire); });
      return pending_.size() != before;
    };
    bool progressed = drop_done();
    const bool many = pending_.size() > 1;
    for (auto& t : pending_) progressed |= Visit(*t, many);
    progressed |= drop_done();
    if (progressed) {
      idle_rounds = 0;
      backoff_us = kMinBackoffUs;
      continue;
    }
    if (++idle_rounds <= kYieldRounds) {
      std::this_thread::yield();
      continue;
    }
    std::unique_lock<std::mutex> l(mu_);
    if (epoch_ == seen) cv_.wait_for(l, std::chrono::microseconds(backoff_us));
    backoff_us = std::min(backoff_us * 2, kMaxBackoffUs);
  }
}

// One visit = one time slice of a task's state machine:
//   waiting for peers: spin (yielding) until all ranks posted, the instance failed,
//     the timeout passed, or the budget ran out (then preempt: state is kept in
//     the task, the daemon moves on).  All posted -> compute + release.
//   claimed (computed by us or inside done()): nothing to do; the last
//     rank to finish reading completes every rank's task, and the daemon drops
//     it once `done` is set.
bool Daemon::Visit(Task& t, bool others_pending) {
  if (t.done.load(std::memory_order_acquire)) return true;
  if (t.claimed.load(std::memory_order_acquire)) return false;  // computed / being computed
  Config& cfg = GetConfig();
  Counters& counters = GetCounters();
  if (t.preempted) {
    t.preempted = false;
    counters.resumes.fetch_add(1, std::memory_order_relaxed);
    TraceEvent(device_, t.spec.key, t.seq, "resume");
  }
  Instance& inst = *t.inst;
  const int n = inst.n;
  const double budget_us = t.sticky ? cfg.sticky_budget_us.load() : cfg.spin_budget_us.load();
  const int64_t budget_ns = static_cast<int64_t>(budget_us * 1e3);
  const double timeout_s = cfg.timeout_s.load();
  const int64_t timeout_ns = static_cast<int64_t>(std::min(timeout_s * 1e9, 9e18));
  const int64_t t0 = NowNs();
  if (t.last_posted < 0) t.last_posted = t.shm ? ShmPosted(t) : inst.posted.load(std::memory_order_relaxed);
  for (;;) {
    // acquire pairs with the release store of the last poster: all slots visible.
    const int posted = t.shm ? ShmPosted(t) : inst.posted.load(std::memory_order_acquire);
    if (posted == n) {
      t.TryCompute();  // unless done() claimed it first
      return true;
    }
    if (t.done.load(std::memory_order_acquire)) return true;  // failed (mismatch/timeout/reset)
    if (t.shm && ShmPoll(t)) return true;  // failed in another process, or a missing rank's process died
    const int64_t now = NowNs();
    if (now - t.start_ns > timeout_ns) {
      FailOnTimeout(t, timeout_s);
      return true;
    }
    if (now - t0 >= budget_ns) {
      // Stickiness: a peer arrived since the previous visit -> it is working
      // on this instance too; give it the long budget next time.
      const bool moved = posted != t.last_posted;
      t.sticky = moved;
      t.last_posted = posted;
      if (others_pending) {
        t.preempted = true;
        counters.preemptions.fetch_add(1, std::memory_order_relaxed);
        TraceEvent(device_, t.spec.key, t.seq, "preempt");
      }
      return moved;
    }
    std::this_thread::yield();
  }
}

}  // namespace dfccl::cpu
