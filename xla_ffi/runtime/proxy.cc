// The proxy thread: the submit kernels' records, completions, failures the
// device decided, the daemon's relaunch and grid changes, and the watchdog.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <sstream>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "dfccl/host.h"
#include "runtime/driver.h"
#include "runtime/runtime.h"

namespace dfccl::gpu {
// Takes the runtime lock for the proxy; if a thread holds it longer than the
// watchdog's timeout (blocked inside a CUDA call, so the watchdog cannot run),
// says so on stderr once instead of hanging silently.
std::unique_lock<std::timed_mutex> Runtime::ProxyLock() {
  std::unique_lock lk(mu_, std::chrono::duration<double>(timeout_s_.load()));
  if (!lk.owns_lock()) {
    std::fprintf(stderr,
                 "dfccl: the GPU runtime's lock has been held for over %.0f s by a thread inside a CUDA call "
                 "(%s): collectives cannot time out meanwhile; jax_dfccl.pending() reports what is in flight\n",
                 timeout_s_.load(), busy_in_.load());
    lk.lock();
  }
  return lk;
}

void Runtime::ProxyLoop() {
  while (true) {
    bool busy = false;
    {
      auto lk = ProxyLock();
      if (stop_) return;
      const auto now = Clock::now();
      for (auto& [ord, d] : devices_) {
        try {
          PollDevice(*d, now);
        } catch (const Error& ex) {
          if (d->error.ok()) { d->error = Status::Of(ex); d->has_error = true; }
        } catch (const std::exception& ex) {
          if (d->error.ok()) { d->error = Status{ErrorCode::kInternal, ex.what()}; d->has_error = true; }
        }
      }
      if (std::string e = ce_.error(); !e.empty())
        for (auto& [ord, d] : devices_)
          if (d->error.ok()) { d->error = Status{ErrorCode::kInternal, e}; d->has_error = true; }
      for (auto& [ord, d] : devices_) busy = busy || d->oldest < d->seen || d->ce_oldest < d->ce_next;
    }
    // Short sleeps while collectives are pending (slots recycle promptly), longer when idle.
    std::this_thread::sleep_for(std::chrono::microseconds(busy ? 20 : 100));
  }
}

void Runtime::PollDevice(Device& d, Clock::time_point now) {
  PollRecords(d, now);
  PollRing(d, d.info, d.oldest, d.seen, d.host->done, now);
  CheckPeersAlive(d, now);
  PollRing(d, d.ce_info, d.ce_oldest, d.ce_next, d.host->ce_done, now);
  if (d.oldest >= d.seen) { d.backoff_us = 20; return; }
  if (d.pending_large > 0 && Running(d) && d.workers < cfg_.large_workers()) {
    d.host->resize = d.launch_id;  // a large task arrived inside a command buffer: a larger daemon
    Launch(d);
  }
  if (!Running(d) && now >= d.next_relaunch) {
    Launch(d);
    d.backoff_us = std::min<int64_t>(d.backoff_us * 2, static_cast<int64_t>(cfg_.relaunch_max_us));
    d.next_relaunch = now + std::chrono::microseconds(d.backoff_us);
  }
}

// The submit kernels' records (HostShared::sub), in ticket order.
void Runtime::PollRecords(Device& d, Clock::time_point now) {
  while (true) {
    const uint32_t e = d.seen % kTaskRing;
    volatile SubRec& r = d.host->sub[e];
    const uint32_t gen = r.gen;
    if (static_cast<int32_t>(gen - Gen(d.seen)) < 0) break;
    std::atomic_thread_fence(std::memory_order_acquire);
    TaskInfo& ti = d.info[e];
    ti = TaskInfo{};
    ti.ticket = d.seen;
    ti.t = now;
    ti.done = false;
    if (gen == Gen(d.seen)) {  // (a newer generation: the record was overwritten before it was read)
      const int32_t site = r.site;
      ti.seq = r.seq;
      if (site >= 0 && site < static_cast<int32_t>(d.sites.size())) {
        const Site* st = d.sites[site].get();
        ti.site = st;
        ti.comm = st->c;
        ti.key_hash = st->key_hash;
        ti.msg_bytes = st->msg_bytes;
        ti.large = st->large;
      }
    }
    d.pending_large += ti.large ? 1 : 0;
    d.seen++;
  }
}

// Completions of one ticket ring (daemon or copy engine), then the watchdog.
template <size_t N>
void Runtime::PollRing(Device& d, std::array<TaskInfo, N>& info, uint64_t& oldest, uint64_t next,
                       const volatile uint32_t* done, Clock::time_point now) {
  const bool daemon = static_cast<const void*>(&info) == static_cast<const void*>(&d.info);
  for (uint64_t t = oldest; t < next; ++t) {
    TaskInfo& ti = info[t % N];
    if (!ti.done && done[t % N] == Gen(t, N)) {
      ti.done = true;
      d.pending_large -= ti.large ? 1 : 0;
      if (daemon) {
        const uint32_t status = d.host->status[t % N];
        (status != kStatusOk ? d.failed : d.completed)++;
        OnDaemonTaskDone(d, ti, status);
      } else {
        (ti.inst && ti.inst->failed ? d.failed : d.completed)++;
        OnTaskDone(d, ti);
      }
    }
  }
  while (oldest < next && info[oldest % N].done) oldest++;
  if (oldest >= next) return;
  const auto limit = std::chrono::duration<double>(cfg_.timeout_s);
  // Tickets are seen in order, so the oldest pending one is the first to time out:
  // the watchdog scan (under the lock every handler needs) runs only once it has.
  if (now - info[oldest % N].t <= limit) return;
  for (uint64_t t = oldest; t < next; ++t) {
    TaskInfo& ti = info[t % N];
    if (ti.done || now - ti.t <= limit) continue;
    std::ostringstream why;
    why << "timed out after " << cfg_.timeout_s << " s: ";
    if (daemon) {
      if (!ti.site || ti.comm->reported.count({ti.key_hash, ti.seq})) continue;
      std::vector<int> missing;
      MatchEntry m{};
      bool found = false;
      if (ti.site->identity) {  // no match entry: the senders' headers in this rank's staging tell who started it
        const uint32_t arrived = IdentityArrived(d, ti, t);
        for (int r = 0; r < ti.comm->n; ++r)
          if ((ti.site->senders >> r & 1) && !(arrived >> r & 1)) missing.push_back(r);
        if (missing.empty())
          why << "every rank it receives from started it; its own message waits for a free staging cell at a peer "
                 "(every way of its key's bucket holds a message of an instance that peer has not started; "
                 "config.tuning.small_slots)";
      } else {
        found = ReadEntry(*ti.comm, ti.key_hash, ti.seq, &m);
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
      AbortDaemonInstance(*ti.comm, ti.key_hash, ti.seq, ErrorCode::kDeadlineExceeded,
                          InstanceName(*ti.comm, ti.site->key, ti.seq) + " " + why.str());
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
        why << (ce_.Pending(ti.comm, ti.inst->key_hash, ti.inst->seq) ? "all inputs ready, not issued)"
                                                                         : "issued, copies not complete)");
      }
    } else {
      why << "rank(s) [";
      for (size_t i = 0; i < missing.size(); ++i)
        why << (i ? ", " : "") << missing[i] << " (GPU " << ti.comm->ordinals[missing[i]] << ")";
      why << "] never started it";
    }
    Abort(*ti.comm, *ti.inst, ErrorCode::kDeadlineExceeded, why.str());
  }
}

// Daemon-path instances pending on groups spanning processes: a peer process of this
// host that exited fails them now (naming the rank), not only at the timeout.
void Runtime::CheckPeersAlive(Device& d, Clock::time_point now) {
  if (d.oldest >= d.seen || now < d.next_peer_check) return;
  d.next_peer_check = now + std::chrono::milliseconds(20);
  std::map<Comm*, int> dead;  // comm -> its first exited rank (-1: all alive)
  for (uint64_t t = d.oldest; t < d.seen; ++t) {
    TaskInfo& ti = d.info[t % kTaskRing];
    if (ti.done || !ti.site || !ti.comm || !ti.comm->cross_process) continue;
    Comm& c = *ti.comm;
    auto [it, fresh] = dead.emplace(&c, -1);
    if (fresh)
      for (int r = 0; r < static_cast<int>(c.pids.size()) && it->second < 0; ++r)
        if (c.pids[r] > 0 && !ProcessAlive(c.pids[r])) it->second = r;
    const int r = it->second;
    if (r < 0 || c.reported.count({ti.key_hash, ti.seq})) continue;
    std::ostringstream why;
    why << "rank " << r << " (device " << c.globals[r] << ", process " << c.pids[r]
        << " on this host) exited before it completed";
    AbortDaemonInstance(c, ti.key_hash, ti.seq, ErrorCode::kAborted,
                        InstanceName(c, ti.site->key, ti.seq) + ": " + why.str());
  }
}

std::string Runtime::InstanceName(const Comm& c, const std::string& key, uint64_t seq) const {
  std::ostringstream msg;
  msg << "dfccl: collective '" << key << "' (sequence " << seq << ", group of GPUs [";
  for (int i = 0; i < c.n; ++i) msg << (i ? "," : "") << c.globals[i];
  msg << "])";
  return msg.str();
}

void Runtime::SetCommError(Comm& c, ErrorCode code, const std::string& msg) {
  RecordError(msg);
  for (int ord : c.ordinals) {
    if (ord < 0) continue;  // another process's device: its own runtime reports it
    Device& d = *devices_[ord];
    if (d.error.ok()) {
      d.error = Status{code, msg};
      d.error_once = true;
      d.has_error.store(true, std::memory_order_release);
    }
  }
}

// The instance's entry in the communicator's match table (a copy), if it has one.
bool Runtime::ReadEntry(Comm& c, uint64_t key_hash, uint64_t seq, MatchEntry* out) {
  const uint64_t id = MatchId(key_hash, seq);
  const int b = MatchBucket(id);
  std::vector<MatchEntry> ways(kMatchWays);
  try {
    CopyOut(*devices_[c.io_ordinal], ways.data(), &c.table->entry[b][0], sizeof(MatchEntry) * kMatchWays);
  } catch (const std::exception&) {
    return false;
  }
  for (const MatchEntry& m : ways)
    if (m.id == id && m.key_hash == key_hash && m.seq == seq) { *out = m; return true; }
  return false;
}

// An identity task's sources whose message has arrived at this rank (bit r), read
// from its staging's headers (device/task.h, "identity"); all of them once its
// first lane received.  Ticket t: its ring entry.
uint32_t Runtime::IdentityArrived(Device& d, const TaskInfo& ti, uint64_t t) {
  const Comm& c = *ti.comm;
  const PoolGeom& g = c.view.pool[0];
  const int ways = IdentityWays(g.nslots), first = IdentityBucket(ti.key_hash, g.nslots);
  const uint32_t tag = IdentityTag(ti.key_hash, ti.seq);
  std::vector<uint64_t> heads(static_cast<size_t>(ways) * c.n * g.lanes);  // [way][src][lane]
  LaneState lane{};
  try {
    CopyOut(d, heads.data(), c.view.flags[0][ti.site->rank] + PoolCell(first, c.n, 0, g.lanes, 0),
            heads.size() * sizeof(uint64_t));
    CopyOut(d, &lane, &d.dev->lane[t % kTaskRing][0], sizeof(lane));
  } catch (const std::exception&) {
    return 0;
  }
  uint32_t m = 0;
  for (int r = 0; r < c.n; ++r)
    for (int w = 0; w < ways; ++w)
      if (lane.c_recv || static_cast<uint32_t>(heads[PoolCell(w, c.n, r, g.lanes, 0)] >> 32) == tag)
        m |= 1u << r;
  return m;
}

// A daemon task completed: a failure the device decided (mismatch, a peer's
// failure, ...) becomes the error of the group's devices, reported once.
void Runtime::OnDaemonTaskDone(Device& d, const TaskInfo& ti, uint32_t status) {
  (void)d;
  if (status == kStatusOk || status == kStatusAborted || !ti.site) return;  // kStatusAborted: the host's own message
  Comm& c = *ti.comm;
  if (!c.reported.insert({ti.key_hash, ti.seq}).second) return;
  const uint32_t code = status & 0xff;
  const int a = (status >> 8) & 0xff, b = (status >> 16) & 0xff;
  const std::string name = InstanceName(c, ti.site->key, ti.seq);
  auto sig_of = [&](int rank) -> std::string {
    if (rank >= 0 && rank < c.n && c.ordinals[rank] < 0) return "another signature (in another process)";
    if (rank < 0 || rank >= c.n || !devices_.count(c.ordinals[rank])) return "?";
    for (const auto& s : devices_[c.ordinals[rank]]->sites)
      if (s->c == &c && s->key_hash == ti.key_hash) return s->signature;
    return "?";
  };
  std::ostringstream msg;
  ErrorCode ec = ErrorCode::kAborted;
  switch (code) {
    case kStatusMismatch:
      ec = ErrorCode::kFailedPrecondition;
      msg << name << ": rank " << b << " started it as " << sig_of(b) << " but rank " << a << " as " << sig_of(a);
      break;
    case kStatusTwice:
      ec = ErrorCode::kFailedPrecondition;
      msg << name << " started twice by rank " << a;
      break;
    case kStatusUnaligned:
      ec = ErrorCode::kInvalidArgument;
      msg << name << ": buffers not 16-byte aligned";
      break;
    case kStatusNoEntry:
      ec = ErrorCode::kResourceExhausted;
      msg << name << ": no free entry in the match table";
      break;
    case kStatusStageBusy:  // device/task.h, "staged"
      msg << name << ": rank " << a << " started it while an earlier instance started at the same place of its "
          << "program was still in flight (that program stopped before the instance's done, or more than "
          << kStageSlots << " instances of one start are in flight); that instance ends when every rank has started "
          << "it or after timeout_s";
      break;
    default:
      msg << name << " failed on rank " << a << " first";
  }
  SetCommError(c, ec, msg.str());
}

// Watchdog: fails a daemon-path instance on every local rank (the control warps
// also mark its match entry failed, so ranks of other processes abort it too).
void Runtime::AbortDaemonInstance(Comm& c, uint64_t key_hash, uint64_t seq, ErrorCode code, const std::string& msg) {
  c.reported.insert({key_hash, seq});
  SetCommError(c, code, msg);
  for (int ord : c.ordinals) {
    auto it = devices_.find(ord);
    if (it == devices_.end()) continue;
    Device& d = *it->second;
    bool any = false;
    for (uint64_t t = d.oldest; t < d.seen; ++t) {
      const TaskInfo& ti = d.info[t % kTaskRing];
      if (ti.done || ti.comm != &c || ti.key_hash != key_hash || ti.seq != seq) continue;
      d.host->abort[t % kTaskRing] = Gen(t);
      any = true;
    }
    if (!any) continue;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    d.host->abort_gen = d.host->abort_gen + 1;
    EnsureRunning(d);
  }
}

void Runtime::OnTaskDone(Device& d, TaskInfo& ti) {
  Instance* inst = ti.inst;
  Comm* c = ti.comm;
  ti.inst = nullptr;
  if (!inst) return;
  inst->done++;
  const bool all = inst->done == inst->nranks || (inst->failed && inst->done == static_cast<int>(inst->tasks.size()));
  if (!all) return;
  const auto id = std::make_pair(inst->key_hash, inst->seq);
  if (inst->failed) {
    // Keep failed instances (a late rank gets the error); no task refers to it any more.
    auto it = c->live.find(id);
    if (it != c->live.end()) { c->failed[id] = std::move(it->second); c->live.erase(it); }
  } else {
    c->live.erase(id);
  }
  (void)d;
}

// The copy-engine path's abort (host-matched instances).
void Runtime::Abort(Comm& c, Instance& inst, ErrorCode code, const std::string& why) {
  inst.failed = true;
  SetCommError(c, code, InstanceName(c, inst.key, inst.seq) + " " + why);
  // Once issued, their copies complete on their own (all inputs were ready);
  // otherwise the host releases the ranks' done waits.
  const bool all_started = inst.started == (1u << c.n) - 1;
  const bool release_ce = !all_started || ce_.Cancel(&c, inst.key_hash, inst.seq);
  if (!release_ce) return;
  for (auto& [d, tagged] : inst.tasks) {
    const uint64_t ticket = tagged & ~kCeTicket;
    d->host->ce_done[ticket % kCeRing] = Gen(ticket, kCeRing);  // SetCommError set the devices' error above
  }
}

}  // namespace dfccl::gpu
