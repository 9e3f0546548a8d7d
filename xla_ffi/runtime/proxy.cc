// The proxy thread (proxy.h): the submit kernels' records, completions,
// failures the device decided, the daemon's launch, relaunch and grid changes,
// and the watchdog.  Owns the thread and `stop_`; every round holds
// Context::mu (ProxyLock).  Running() is lock-free (the submit hot path).
#include "runtime/proxy.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <sstream>
#include <vector>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "dfccl/host.h"
#include "runtime/communicator.h"
#include "runtime/copy_engine_path.h"
#include "runtime/daemon_path.h"
#include "runtime/driver.h"
#include "runtime/overlap_path.h"

namespace dfccl::gpu {

void Proxy::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] {
    NameThisThread("dfccl-proxy");
    ProxyLoop();
  });
}

void Proxy::Stop() {
  { std::lock_guard lk(ctx_.mu); stop_ = true; }
  if (thread_.joinable()) thread_.join();
}

// Takes the runtime lock for the proxy; if a thread holds it longer than the
// watchdog's timeout (blocked inside a CUDA call, so the watchdog cannot run),
// says so on stderr once instead of hanging silently.
std::unique_lock<std::timed_mutex> Proxy::ProxyLock() {
  std::unique_lock lk(ctx_.mu, std::chrono::duration<double>(ctx_.timeout_s.load()));
  if (!lk.owns_lock()) {
    std::fprintf(stderr,
                 "dfccl: the GPU runtime's lock has been held for over %.0f s by a thread inside a CUDA call "
                 "(%s): collectives cannot time out meanwhile; jax_dfccl.pending() reports what is in flight\n",
                 ctx_.timeout_s.load(), ctx_.busy_in.load());
    lk.lock();
  }
  return lk;
}

void Proxy::ProxyLoop() {
  while (true) {
    bool busy = false;
    {
      auto lk = ProxyLock();
      if (stop_) return;
      const auto now = Clock::now();
      for (auto& [ord, d] : ctx_.devices) {
        try {
          PollDevice(*d, now);
        } catch (const Error& ex) {
          if (d->error.ok()) { d->error = Status::Of(ex); d->has_error = true; }
        } catch (const std::exception& ex) {
          if (d->error.ok()) { d->error = Status{ErrorCode::kInternal, ex.what()}; d->has_error = true; }
        }
      }
      overlap_.Poll(now);  // the fused ops' completions and deadline (no CUDA call: host-mapped words)
      if (std::string e = ctx_.ce.error(); !e.empty())
        for (auto& [ord, d] : ctx_.devices)
          if (d->error.ok()) { d->error = Status{ErrorCode::kInternal, e}; d->has_error = true; }
      busy = overlap_.Busy();
      for (auto& [ord, d] : ctx_.devices) {
        const DaemonPath::PerDevice& q = daemon_.Of(*d);
        const CopyEnginePath::PerDevice& cq = ce_path_.Of(*d);
        busy = busy || q.oldest < q.seen || cq.ce_oldest < cq.ce_next;
      }
    }
    // Short sleeps while collectives are pending (slots recycle promptly), longer when idle.
    std::this_thread::sleep_for(std::chrono::microseconds(busy ? 20 : 100));
  }
}

void Proxy::PollDevice(Device& d, Clock::time_point now) {
  DaemonPath::PerDevice& q = daemon_.Of(d);
  CopyEnginePath::PerDevice& cq = ce_path_.Of(d);
  daemon_.PollRecords(d, now);
  PollRing(d, q.info, q.oldest, q.seen, d.host->done, now);
  CheckPeersAlive(d, now);
  PollRing(d, cq.ce_info, cq.ce_oldest, cq.ce_next, d.host->ce_done, now);
  if (q.oldest >= q.seen) { d.backoff_us = 20; return; }
  if (d.pending_large > 0 && Running(d) && d.workers < ctx_.LargeWorkers(d)) {
    d.host->resize = d.launch_id;  // a large task arrived inside a command buffer: a larger daemon
    Launch(d);
  }
  if (!Running(d) && now >= d.next_relaunch) {
    Launch(d);
    d.backoff_us = std::min<int64_t>(d.backoff_us * 2, static_cast<int64_t>(ctx_.cfg.relaunch_max_us));
    d.next_relaunch = now + std::chrono::microseconds(d.backoff_us);
  }
}

// Completions of one ticket ring (daemon or copy engine), then the watchdog.
template <size_t N>
void Proxy::PollRing(Device& d, std::array<TaskInfo, N>& info, uint64_t& oldest, uint64_t next,
                     const volatile uint32_t* done, Clock::time_point now) {
  const bool daemon = static_cast<const void*>(&info) == static_cast<const void*>(&daemon_.Of(d).info);
  for (uint64_t t = oldest; t < next; ++t) {
    TaskInfo& ti = info[t % N];
    if (!ti.done && done[t % N] == Gen(t, N)) {
      ti.done = true;
      d.pending_large -= ti.large ? 1 : 0;
      if (daemon) {
        const uint32_t status = d.host->status[t % N];
        (status != kStatusOk && !ti.tomb ? d.failed : d.completed)++;  // a tombstone's status is no error
        daemon_.OnDaemonTaskDone(d, ti, status);
      } else {
        (ti.inst && ti.inst->failed ? d.failed : d.completed)++;
        ce_path_.OnTaskDone(d, ti);
      }
    }
  }
  while (oldest < next && info[oldest % N].done) oldest++;
  if (oldest >= next) return;
  const auto limit = std::chrono::duration<double>(ctx_.cfg.timeout_s);
  // Tickets are seen in order, so the oldest pending one is the first to time out:
  // the watchdog scan (under the lock every handler needs) runs only once it has.
  if (now - info[oldest % N].t <= limit) return;
  for (uint64_t t = oldest; t < next; ++t) {
    TaskInfo& ti = info[t % N];
    if (ti.done || now - ti.t <= limit) continue;
    std::ostringstream why;
    why << "timed out after " << ctx_.cfg.timeout_s << " s: ";
    if (daemon) {
      if (ti.tomb) {  // a peer never sent its message (it failed too, or stopped): the tombstone goes, silently
        daemon_.AbortTask(d, t);
        ti.t = now;
        continue;
      }
      if (!ti.site || ti.comm->Failed(ti.key_hash, ti.seq)) continue;
      if (ti.site->announce) {  // its deadline is the device's (the home's verdict names the ranks); this is the backstop
        const auto backstop = limit + std::chrono::duration<double>(Communicator::AnnounceGraceS() + 2.0);
        if (now - ti.t <= backstop) continue;
        why << "no rank decided its end (group spanning hosts: the announcements' deadline passed; daemon "
            << (Running(d) ? "running" : "stopped") << ")";
        daemon_.AbortDaemonInstance(*ti.comm, ti.key_hash, ti.seq, ErrorCode::kDeadlineExceeded,
                                    ti.comm->InstanceName(ti.site->key, ti.seq) + " " + why.str());
        continue;
      }
      std::vector<int> missing;
      MatchEntry m{};
      bool found = false;
      if (ti.site->identity) {  // no match entry: the senders' headers in this rank's staging tell who started it
        const uint32_t arrived = daemon_.IdentityArrived(d, ti, t);
        for (int r = 0; r < ti.comm->n; ++r)
          if ((ti.site->senders >> r & 1) && !(arrived >> r & 1)) missing.push_back(r);
        if (missing.empty())
          why << "every rank it receives from started it; its own message waits for a free staging cell at a peer "
                 "(every way of its key's bucket holds a message of an instance that peer has not started; "
                 "config.tuning.small_slots)";
      } else {
        found = daemon_.ReadEntry(*ti.comm, ti.key_hash, ti.seq, &m);
        for (int r = 0; r < ti.comm->n; ++r)
          if (!found ? r != ti.site->rank : !(m.arrived & (1u << r))) missing.push_back(r);
        if (!found) {
          // This rank's arrival creates the entry when no other rank's did: without one, no
          // rank of the group has arrived, this one included.
          why << "no rank has arrived at it in the match table: every way of its bucket (" << kMatchWays
              << ") held other instances, or this GPU's daemon never took the task (daemon "
              << (Running(d) ? "running" : "stopped") << ")";
        } else if (missing.empty() && m.slot < 0 && m.failed == 0) {
          // Every slot of its pool stayed in use, the reserve too (device/match.cuh): by
          // instances that did not complete either.
          why << "every rank started it, but no instance slot of its pool became free (all "
              << (m.pool == 0 ? "config.tuning.small_slots" : ti.comm->direct ? "config.tuning.direct_slots" : "config.tuning.large_slots")
              << " slots in use by instances that did not complete)";
        } else if (missing.empty()) {
          why << "every rank started it but it did not complete";
        }
      }
      if (!missing.empty() && (found || ti.site->identity)) {
        why << "rank(s) [";
        for (size_t i = 0; i < missing.size(); ++i)
          why << (i ? ", " : "") << missing[i] << " (device " << ti.comm->globals[missing[i]] << ")";
        why << "] never started it";
        if (ti.site->identity) why << " (or started it with a size that does not take the small-message path)";
      }
      daemon_.AbortDaemonInstance(*ti.comm, ti.key_hash, ti.seq, ErrorCode::kDeadlineExceeded,
                                  ti.comm->InstanceName(ti.site->key, ti.seq) + " " + why.str());
      continue;
    }
    if (!ti.inst || ti.inst->failed) continue;
    std::vector<int> missing;
    for (int r = 0; r < ti.inst->nranks; ++r)
      if (!(ti.inst->started & (1u << r))) missing.push_back(r);
    if (missing.empty()) {
      std::vector<int> not_ready;
      for (int r = 0; r < ti.inst->nranks; ++r) {
        const CeRank& cr = ti.inst->ce_ranks[r];
        if (static_cast<int32_t>(*cr.ready - cr.gen) < 0) not_ready.push_back(r);
      }
      why << "every rank started it (copy engine; ";
      if (!not_ready.empty()) {
        why << "the stream of rank(s) [";
        for (size_t i = 0; i < not_ready.size(); ++i) why << (i ? ", " : "") << not_ready[i];
        why << "] never reached it)";
      } else {
        why << (ctx_.ce.Pending(ti.comm, ti.inst->key_hash, ti.inst->seq) ? "all inputs ready, not issued)"
                                                                             : "issued, copies not complete)");
      }
    } else {
      why << "rank(s) [";
      for (size_t i = 0; i < missing.size(); ++i)
        why << (i ? ", " : "") << missing[i] << " (GPU " << ti.comm->ordinals[missing[i]] << ")";
      why << "] never started it";
    }
    ce_path_.Abort(*ti.comm, *ti.inst, ErrorCode::kDeadlineExceeded, why.str());
  }
}

// Daemon-path instances pending on groups spanning processes: a peer process that
// exited fails them now (naming the rank), not only at the timeout.  A peer on this
// host: its pid is gone.  On another host (hosts simulated by
// config.testing.processes_per_host included: no pid across them): the liveness
// watch of jax_dfccl.initialize reported its process lost (Context::lost).
void Proxy::CheckPeersAlive(Device& d, Clock::time_point now) {
  DaemonPath::PerDevice& q = daemon_.Of(d);
  if (q.oldest >= q.seen || now < d.next_peer_check) return;
  d.next_peer_check = now + std::chrono::milliseconds(20);
  std::map<Communicator*, std::pair<int, std::string>> dead;  // comm -> its first dead rank (-1: none), why
  for (uint64_t t = q.oldest; t < q.seen; ++t) {
    TaskInfo& ti = q.info[t % kTaskRing];
    if (ti.done || !ti.site || !ti.comm || !ti.comm->cross_process) continue;
    Communicator& c = *ti.comm;
    auto [it, fresh] = dead.emplace(&c, std::make_pair(-1, std::string()));
    if (fresh) it->second = FirstDeadRank(c);
    const int r = it->second.first;
    if (r < 0 || c.Failed(ti.key_hash, ti.seq)) continue;
    daemon_.AbortDaemonInstance(c, ti.key_hash, ti.seq, ErrorCode::kAborted,
                                c.InstanceName(ti.site->key, ti.seq) + ": " + it->second.second);
  }
}

std::pair<int, std::string> Proxy::FirstDeadRank(const Communicator& c) {
  const int n = static_cast<int>(c.globals.size());
  const bool hosts = static_cast<int>(c.hosts.size()) == n;
  int32_t here = -1;  // this process's host (of a local rank)
  for (int r = 0; r < n && hosts; ++r)
    if (c.ordinals[r] >= 0) here = c.hosts[r];
  for (int r = 0; r < n; ++r) {
    const bool same_host = !hosts || c.hosts[r] == here;
    if (same_host && r < static_cast<int>(c.pids.size()) && c.pids[r] > 0 && !ProcessAlive(c.pids[r])) {
      std::ostringstream why;
      why << "rank " << r << " (device " << c.globals[r] << ", process " << c.pids[r]
          << " on this host) exited before it completed";
      return {r, why.str()};
    }
  }
  if (ctx_.nlost.load() == 0) return {-1, {}};
  std::lock_guard lk(ctx_.lost_mu);
  for (int r = 0; r < n; ++r) {
    if (c.ordinals[r] >= 0) continue;
    auto it = ctx_.lost.find(c.globals[r]);
    if (it == ctx_.lost.end()) continue;
    std::ostringstream why;
    why << "rank " << r << " (device " << c.globals[r];
    if (hosts) why << ", host " << c.hosts[r];
    why << ") was lost before it completed: " << it->second;
    return {r, why.str()};
  }
  return {-1, {}};
}

// No CUDA call.  A daemon leaves only after storing `exiting` (idle/stall quit;
// the proxy relaunches it when a submit kernel's record arrives) or when the host
// asked it to (resize, and then a successor is already queued).
bool Proxy::Running(Device& d) { return d.launched && d.host->exiting != d.launch_id; }

// The daemon kernel has not returned yet (for stats: it may still be on its way out).
bool Proxy::Alive(Device& d) { return d.launched && cudaEventQuery(d.ev) == cudaErrorNotReady; }

void Proxy::Launch(Device& d) {
  DeviceGuard guard(d.ordinal);
  d.launch_id++;
  d.workers = d.pending_large > 0 ? ctx_.LargeWorkers(d) : ctx_.cfg.workers();
  DaemonParams p{};
  p.dev = d.dev;
  p.host = d.host_dev;
  p.launch_id = d.launch_id;
  p.workers = d.workers;
  p.spin_ns = ctx_.cfg.spin_ns();
  p.sticky_max = ctx_.cfg.sticky_max();
  p.trace = ctx_.cfg.trace ? 1 : 0;
  p.idle_ns = ctx_.cfg.idle_ns();
  p.stall_ns = ctx_.cfg.stall_ns();
  p.map_gen = d.map_gen = ctx_.ipc.gen();  // before the launch: every range mapped so far is older than it
  ctx_.busy_in = "a daemon launch";
  cudaError_t err = ctx_.engine->launch(p, d.stream);
  if (err == cudaSuccess) err = cudaEventRecord(d.ev, d.stream);
  ctx_.busy_in = "nothing known";
  DFCCL_CHECK_CODE(err == cudaSuccess, ::dfccl::ErrorCode::kInternal, "dfccl: daemon launch on GPU " << d.ordinal << ": " << cudaGetErrorString(err));
  d.launched = true;
  d.launches++;
  d.blocks_launched += p.workers + 1;
}

void Proxy::EnsureRunning(Device& d) {
  if (!Running(d)) Launch(d);
}

void Proxy::Replace(Device& d) {
  if (!Running(d)) return;
  d.host->resize = d.launch_id;  // it leaves at its next look at the host's words
  for (const auto t0 = Clock::now(); Alive(d) && Clock::now() - t0 < std::chrono::seconds(2);)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  Launch(d);
}

}  // namespace dfccl::gpu
