// The one spin-wait helper of the daemon.  Every wait on a peer (arrival flag,
// credit) is a poll through BlockPoll inside a loop governed by a Spinner: the
// Spinner's budget is the timeout of the spin, and when it runs out the caller
// saves its state and returns (preemption), so another task can run.  Aborts
// (host watchdog) are observed by the scheduler between steps.
#pragma once

#include "device/primitives.cuh"

namespace dfccl::gpu {

// What one step of a lane achieved (bits): kMoved, kDone; kPreempted = neither finished nor allowed to spin on.
enum StepResult : int { kPreempted = 0, kDone = 1, kMoved = 2 };

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

// Budget of spinning without progress, in SM clock cycles (thread 0's clock).
class Spinner {
 public:
  DFCCL_DEV explicit Spinner(int64_t budget) : budget_(budget) { start_ = clock64(); }
  DFCCL_DEV void Progress() { start_ = clock64(); }
  // True while budget is left; block-uniform.
  DFCCL_DEV bool KeepSpinning() {
    return BlockPoll([&] { return clock64() - start_ < budget_; });
  }
 private:
  int64_t budget_;
  long long start_;
};

}  // namespace dfccl::gpu
