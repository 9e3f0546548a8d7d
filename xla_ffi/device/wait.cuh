// The one spin-wait helper of the daemon.  Every wait on a peer (arrival flag,
// credit) is a poll through BlockPoll inside a loop governed by a Spinner: the
// Spinner's budget is the timeout of the spin, and when it runs out the caller
// saves its state and returns (preemption), so another task can run.  Aborts
// (host watchdog) are observed by the scheduler between steps.
#pragma once

#include "device/primitives.cuh"

namespace dfccl::gpu {

// What one step of a lane achieved (bits): kMoved, kDone; kPreempted = neither
// finished nor allowed to spin on; kFailed (with kDone): the lane decided its
// task's failure (LaneState::fail).
enum StepResult : int { kPreempted = 0, kDone = 1, kMoved = 2, kFailed = 4 };

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

// Budget of spinning without progress, in nanoseconds of %globaltimer (thread
// 0's reads), so it means the same at any SM clock (config.tuning.spin_budget_us; no
// clock rate is assumed).  The timer's update granularity is up to 1 us on some
// GPUs (32 ns on others), which bounds a budget's precision, not its meaning.
class Spinner {
 public:
  DFCCL_DEV explicit Spinner(int64_t budget_ns) : budget_(static_cast<uint64_t>(budget_ns)) { start_ = GlobalTimer(); }
  DFCCL_DEV void Progress() { start_ = GlobalTimer(); }
  // True while budget is left; block-uniform.
  DFCCL_DEV bool KeepSpinning() {
    return BlockPoll([&] { return GlobalTimer() - start_ < budget_; });
  }
 private:
  uint64_t budget_;
  uint64_t start_;
};

}  // namespace dfccl::gpu
