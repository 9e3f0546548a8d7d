// One daemon thread per CPU device: the consumer of that device's tasks.
//
// It round-robins over its pending tasks.  A task waiting for peers is spun for
// its budget (spin_budget_us, or sticky_budget_us when a peer's arrival was
// observed since the previous visit) and then preempted: the daemon moves on to
// the next task, so no order of starts can make it wait on the wrong one.
// When nothing progresses it yields a few rounds, then sleeps on its condition
// variable with a growing timeout (50 us .. 1 ms); the event that lets a task
// progress ("all ranks posted") bumps the epoch and wakes it.  A submission
// alone does not wake it (the task cannot progress before its peers post) unless
// the daemon is in deep sleep: with no task for a while it stops polling and
// waits without a timeout.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

namespace dfccl::cpu {

struct Task;

class Daemon {
 public:
  explicit Daemon(int64_t device);
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  int64_t device() const { return device_; }
  // Hands a task to the daemon (producer side; never blocks for long).
  // urgent: the task can progress now (wake the daemon in any case).
  void Submit(std::shared_ptr<Task> task, bool urgent);
  // Something the daemon may be waiting for happened.
  void Wake();

 private:
  void Loop();
  // Visits one task; returns true if its state changed (progress).
  bool Visit(Task& task, bool others_pending);

  const int64_t device_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Task>> inbox_;  // guarded by mu_
  uint64_t epoch_ = 0;                       // guarded by mu_
  bool deep_sleep_ = false;                  // guarded by mu_: waiting without timeout
  std::vector<std::shared_ptr<Task>> pending_;  // daemon thread only
};

// The daemon of a device, started on first use.  Daemons (and the runtime's
// globals) are never destroyed and their threads are detached, so they neither
// keep the process alive nor touch destroyed objects during interpreter exit.
Daemon& DaemonFor(int64_t device);
int64_t NumDaemons();
// Wakes every daemon (an instance spanning processes may have progressed).
void WakeAllDaemons();

}  // namespace dfccl::cpu
