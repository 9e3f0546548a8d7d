// The one wait of the device code (DeepEP's `timeout_while` is the model).
// Every wait on another agent — a peer's flag, the daemon's done word, a
// bucket lock, the host mover's word — passes through this header, so its
// bound, its abort check, its back-off and what happens at the bound are
// written down in one place (the list: docs/design/waits.md).
//
//  * The clock: nanoseconds of %globaltimer since the wait began (Elapsed),
//    so a bound means the same at any SM clock (no clock rate is assumed).
//    The timer's update granularity is up to 1 us on some GPUs (32 ns on
//    others), which bounds a bound's precision, not its meaning.
//  * SpinWait<Policy>(ready, bound_ns, aborted): one thread waits for `ready`.
//    The Policy (a struct of constants and a Sleep, below) gives the clock's
//    and the abort check's cadence in failed polls and the back-off.  The
//    first poll happens before any clock read, so a wait that is over at once
//    costs one poll.  The caller decides what the end means: kBound is
//    "preempt / retry later" (LockBucket) or fatal; SpinWaitOrTrap is the
//    fatal form, for waits on XLA's stream where no handler can report a
//    failure: it runs the caller's report (record what, print), then traps, so
//    the execution fails instead of returning a garbage result or hanging.
//  * Spinner: the budget of a daemon lane's step loop, which waits on several
//    conditions at once (credits, flags) while moving data for others; every
//    thread of the block takes the same answer (BlockPoll), and at the bound
//    the lane is preempted (returns kPreempted to the scheduler, which
//    observes aborts between steps).  Same clock, same comparison.
//
// Cost: everything is forceinline and the cadences are compile-time
// constants (a power of two folds to a mask), a policy without an abort check
// has no code for it, and a poll is exactly the caller's loads.
#pragma once

#include <type_traits>

#include "device/primitives.cuh"

namespace dfccl::gpu {

// What one step of a lane achieved (bits): kMoved, kDone; kPreempted = neither
// finished nor allowed to spin on; kFailed (with kDone): the lane decided its
// task's failure (LaneState::fail).
enum StepResult : int { kPreempted = 0, kDone = 1, kMoved = 2, kFailed = 4 };

// How a SpinWait ended.
enum class WaitEnd : int { kReady = 0, kBound = 1, kAborted = 2 };

// The one clock test of every wait: more than bound_ns of %globaltimer since start.
DFCCL_DEV bool Elapsed(uint64_t start, uint64_t bound_ns) { return GlobalTimer() - start > bound_ns; }

// Policy constants of a wait (a policy derives from WaitPolicy and sets what differs):
//   kClockEvery  the clock is read after every kClockEvery-th failed poll (1: each);
//   kAbortEvery  the abort check runs at those clock looks, every kAbortEvery-th
//                failed poll (a multiple of kClockEvery; 0: no abort check);
//   Sleep(it)    the back-off before the next poll, after `it` + 1 failed polls.
struct WaitPolicy {
  static constexpr uint32_t kClockEvery = 1;
  static constexpr uint32_t kAbortEvery = 0;
  static DFCCL_DEV void Sleep(uint32_t) {}
};

// An abort check that never fires (the policy's kAbortEvery is 0 then).
struct NoAbort {
  DFCCL_DEV bool operator()() const { return false; }
};

namespace wait_detail {
// `ready` may take the poll's index (0: the first poll, before the clock is read).
template <class Ready>
DFCCL_DEV bool Poll(Ready& ready, uint32_t n) {
  if constexpr (std::is_invocable_v<Ready&, uint32_t>) return ready(n);
  else return ready();
}
}  // namespace wait_detail

// Polls `ready` until it holds (kReady), `aborted` says so at its cadence
// (kAborted), or more than bound_ns passed since the first failed poll (kBound).
template <class Policy, class Ready, class Abort = NoAbort>
DFCCL_DEV WaitEnd SpinWait(Ready&& ready, uint64_t bound_ns, Abort&& aborted = Abort{}) {
  static_assert(Policy::kClockEvery >= 1, "the clock is read at least every kClockEvery polls");
  static_assert(Policy::kAbortEvery % Policy::kClockEvery == 0, "abort checks happen at clock looks");
  if (wait_detail::Poll(ready, 0u)) return WaitEnd::kReady;
  const uint64_t t0 = GlobalTimer();
  for (uint32_t it = 0;; ++it) {  // `it` wraps after 2^32 polls: harmless (cadences stay periodic)
    Policy::Sleep(it);
    if (wait_detail::Poll(ready, it + 1)) return WaitEnd::kReady;
    if (it % Policy::kClockEvery == Policy::kClockEvery - 1) {
      if constexpr (Policy::kAbortEvery != 0)
        if (it % Policy::kAbortEvery == Policy::kAbortEvery - 1 && aborted()) return WaitEnd::kAborted;
      if (Elapsed(t0, bound_ns)) return WaitEnd::kBound;
    }
  }
}

// The fatal form: where the wait does not end ready, report(end) (records or
// prints what was waited for) and the kernel traps.  For waits no handler can
// report (XLA's stream, a command buffer, a fused kernel): the trap fails the
// execution holding the kernel, never a result that looks valid, never a hang.
template <class Policy, class Ready, class Abort, class Report>
DFCCL_DEV void SpinWaitOrTrap(Ready&& ready, uint64_t bound_ns, Abort&& aborted, Report&& report) {
  const WaitEnd end = SpinWait<Policy>(ready, bound_ns, aborted);
  if (end == WaitEnd::kReady) return;
  report(end);
  __trap();
}

// --- The thread waits' policies (device/; the overlap ops' is overlap/sync.cuh's FlagWait).

// A done word on XLA's stream (device memory, the daemon's; ld.acquire.sys):
// no sleep for the first 65 polls (the common wait is short), then 32 ns, past
// 4096 polls 256 ns; the clock every 1024 polls.  No abort check: the host's
// abort completes the task, which writes the word (with the failed status).
struct DoneWordWait : WaitPolicy {
  static constexpr uint32_t kClockEvery = 1024;
  static DFCCL_DEV void Sleep(uint32_t it) {
    if (it > 64) __nanosleep(it > 4096 ? 256 : 32);
  }
};

// The copy-engine path's done word (host memory: each poll a PCIe read): 200 ns
// between polls; the clock every 1024 polls.  No abort check: the host's abort
// (or its failure to issue the copies) writes the word.
struct HostWordWait : WaitPolicy {
  static constexpr uint32_t kClockEvery = 1024;
  static DFCCL_DEV void Sleep(uint32_t) { __nanosleep(200); }
};

// A match bucket's lock (device/match.cuh): the second attempt at once, then
// 32 ns between attempts; the clock at every failed attempt (the budgets are
// short: 20 us on XLA's stream, 0.5 ms for the control warp).  At the bound the
// caller leaves the task for a later pass (a holder never waits inside).
struct LockWait : WaitPolicy {
  static DFCCL_DEV void Sleep(uint32_t it) {
    if (it > 0) __nanosleep(32);
  }
};

#ifdef __CUDACC__  // block-level waits: CUDA only (the host tests compile the thread waits above)

// Thread 0 evaluates pred once; every thread of the block gets the answer.
template <class P>
DFCCL_DEV bool BlockPoll(P pred) {
  __shared__ int answer;
  if (threadIdx.x == 0) answer = pred() ? 1 : 0;
  __syncthreads();
  const bool r = answer != 0;
  __syncthreads();
  return r;
}

// The budget of a lane's spinning without progress (config.tuning.spin_budget_us,
// grown per lane by its stickiness): thread 0's clock decides for the block.
class Spinner {
 public:
  DFCCL_DEV explicit Spinner(int64_t budget_ns) : budget_(static_cast<uint64_t>(budget_ns)) { start_ = GlobalTimer(); }
  DFCCL_DEV void Progress() { start_ = GlobalTimer(); }
  // True while budget is left; block-uniform.  False: the lane is preempted.
  DFCCL_DEV bool KeepSpinning() {
    return BlockPoll([&] { return !Elapsed(start_, budget_); });
  }

 private:
  uint64_t budget_;
  uint64_t start_;
};

#endif  // __CUDACC__

}  // namespace dfccl::gpu
