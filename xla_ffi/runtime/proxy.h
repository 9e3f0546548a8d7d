// The proxy thread ("dfccl-proxy"): polls every device's ticket rings (the
// daemon path's records and completions, the copy-engine path's completions)
// and the fused-op path's channels (OverlapPath::Poll: completions, deadline),
// launches and relaunches the daemon (and grows its grid for a large task),
// runs the watchdog (timeouts, peer processes that exited) and hands failures
// to the path that owns the instance.
//
// Owns: the thread and its stop flag; the daemon's launch state is in Device.
// Lock: each round of the loop holds Context::mu (ProxyLock: timed, it says on
// stderr when a thread holds it inside a CUDA call past the timeout); `stop_`
// is written and read under it.  Running() reads only Device's atomics and the
// host-mapped words (the submit handler's hot path calls it without the lock);
// Launch and EnsureRunning run under the lock.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <thread>

#include "runtime/context.h"

namespace dfccl::gpu {

class DaemonPath;
class CopyEnginePath;
class OverlapPath;

class Proxy {
 public:
  Proxy(Context& ctx, DaemonPath& daemon, CopyEnginePath& ce, OverlapPath& overlap)
      : ctx_(ctx), daemon_(daemon), ce_path_(ce), overlap_(overlap) {}
  void Start();  // the thread, once (the first device starts it); under mu
  void Stop();   // at exit: takes mu, then joins the thread

  // The daemon: whether it runs (no CUDA call, no lock), whether its kernel has
  // not returned yet (stats), a launch and a launch when it does not run.
  bool Running(Device& d);
  bool Alive(Device& d);
  void Launch(Device& d);
  void EnsureRunning(Device& d);
  // A running daemon asked to leave and waited for (bounded), then a successor
  // launched: for memory allocated after the running one's launch, which memory
  // checkers do not let a running kernel read (tools/memcheck_late_alloc_probe.cu).
  void Replace(Device& d);
  // One device's round: records, completions, watchdog, relaunch (under mu).
  void PollDevice(Device& d, Clock::time_point now);

 private:
  void ProxyLoop();
  std::unique_lock<std::timed_mutex> ProxyLock();
  template <size_t N>
  void PollRing(Device& d, std::array<TaskInfo, N>& info, uint64_t& oldest, uint64_t next,
                const volatile uint32_t* done, Clock::time_point now);
  void CheckPeersAlive(Device& d, Clock::time_point now);
  std::pair<int, std::string> FirstDeadRank(const Communicator& c);  // (-1, ""): every peer alive

  Context& ctx_;
  DaemonPath& daemon_;
  CopyEnginePath& ce_path_;
  OverlapPath& overlap_;
  std::thread thread_;
  bool stop_ = false;
};

}  // namespace dfccl::gpu
