// Start/done on XLA's stream, the daemon's launch/relaunch, the proxy thread
// (completions, slot recycling, relaunch with backoff, watchdog), and the
// module's stats/trace/reset.
#include "runtime/runtime.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "runtime/driver.h"

namespace dfccl::gpu {

Runtime& Runtime::Get() {
  static Runtime* rt = [] {
    auto* r = new Runtime();  // leaked: CUDA's own teardown must come after ours
    std::atexit([] {
      Runtime& g = Get();
      { std::lock_guard lk(g.mu_); g.stop_ = true; }
      if (g.proxy_.joinable()) g.proxy_.join();
      g.ce_.Stop();
    });
    return r;
  }();
  return *rt;
}

Runtime::~Runtime() = default;

void CopyOut(Device& d, void* dst, const void* src, size_t bytes) {
  DeviceGuard guard(d.ordinal);
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, d.aux);
  if (e == cudaSuccess) e = cudaStreamSynchronize(d.aux);
  DFCCL_CHECK_CODE(e == cudaSuccess, ::dfccl::ErrorCode::kInternal, "dfccl: reading device counters: " << cudaGetErrorString(e));
}

void Runtime::FillDesc(Device& d, uint64_t ticket, const CollectiveSpec& spec, const Comm& c, const Instance& inst,
                       const void* in, void* out, int64_t msg_bytes) {
  TaskDesc& t = d.host->desc[ticket % kTaskRing];
  const PoolGeom& g = c.view.pool[inst.pool];
  const int workers = msg_bytes >= cfg_.large_threshold ? cfg_.large_workers() : cfg_.workers();
  const bool direct = c.direct && inst.pool == 1;
  const int64_t unit = direct ? DirectUnitBytes(static_cast<int32_t>(spec.kind), msg_bytes, spec.nranks) : msg_bytes;
  auto [lanes, lane_bytes] = LanePlan(unit, g, workers, cfg_.lane_min_bytes);
  if (direct) {  // lane_bytes becomes the chunk: small enough that every lane gets one, at most kDirectChunk
    const int64_t per_lane = ((unit + lanes - 1) / lanes + 15) / 16 * 16;
    lane_bytes = std::clamp<int64_t>(per_lane, std::min<int64_t>(4096, kDirectChunk), kDirectChunk);
    lanes = static_cast<int>(std::min<int64_t>(lanes, (unit + lane_bytes - 1) / lane_bytes));
  }
  const bool aligned = (reinterpret_cast<uintptr_t>(in) % 16 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
  DFCCL_CHECK(inst.pool != 0 || aligned, "dfccl: collective '" << spec.key << "': buffers not 16-byte aligned");
  t.ticket = ticket;
  t.key_hash = spec.key_hash;
  t.seq = inst.seq;
  t.in = static_cast<const char*>(in);
  t.out = static_cast<char*>(out);
  t.comm = c.dev_copy[spec.rank];
  t.dtype = static_cast<int32_t>(spec.dtype);
  t.msg_bytes = msg_bytes;
  t.lane_bytes = lane_bytes;
  t.kind = static_cast<int32_t>(spec.kind);
  t.reduce = static_cast<int32_t>(spec.reduce);
  t.elem_bytes = static_cast<int32_t>(spec.elem_bytes);
  t.nranks = spec.nranks;
  t.rank = spec.rank;
  t.send_to = spec.send_to;
  t.recv_from = spec.recv_from;
  t.pool = inst.pool;
  t.lanes = lanes;
  t.vec = aligned && msg_bytes % 16 == 0;
  t.epoch = inst.epoch;
  t.slot = inst.slot;
  t.abort = 0;
  t.direct = direct ? 1 : 0;
}

bool Runtime::UseCopyEngine(const CollectiveSpec& spec, const Comm& c) const {
  const int64_t bytes = std::max(spec.in_bytes(), spec.out_elems * spec.elem_bytes);
  const bool reduction = Reduces(spec.kind);
  return cfg_.copy_engine_min_bytes >= 0 && bytes >= cfg_.copy_engine_min_bytes && c.n > 1 &&
         (!reduction || bytes >= cfg_.copy_engine_reduce_min_bytes) && CopyEngine::Supports(spec.kind, c.n);
}

// Copy-engine path: a ticket of the device's second ring; the instance goes to
// the mover once its last rank has started.
void Runtime::StartCopyEngine(Device& d, Comm& c, Instance& inst, const CollectiveSpec& spec, const void* in,
                              void* out, uint64_t ticket) {
  const uint32_t e = ticket % kCeRing;
  inst.ce_ranks.resize(c.n);
  inst.ce_ranks[spec.rank] = CeRank{d.ordinal, static_cast<const char*>(in), static_cast<char*>(out), spec.recv_from,
                                    &d.host->ce_ready[e], const_cast<uint32_t*>(&d.host_dev->ce_done[e]), &d.host->ce_done[e],
                                    Gen(ticket, kCeRing)};
  if (inst.started != (1u << c.n) - 1) return;
  CeOp op;
  op.comm = &c;
  op.key_hash = inst.key_hash;
  op.seq = inst.seq;
  op.kind = spec.kind;
  op.reduce = spec.reduce;
  op.dtype = spec.dtype;
  op.elem_bytes = spec.elem_bytes;
  op.elems = spec.elems_per_block;
  op.ranks = inst.ce_ranks;
  ce_.Submit(std::move(op));
}

// The handlers' lock: a short spin before sleeping.  XLA's device threads run
// the same program in step and reach it together; a futex sleep and wake-up
// per call would cost more than the section it guards.
std::unique_lock<std::timed_mutex> Runtime::HandlerLock() {
  for (int i = 0; i < 4096; ++i) {
    if (mu_.try_lock()) return std::unique_lock<std::timed_mutex>(mu_, std::adopt_lock);
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return std::unique_lock<std::timed_mutex>(mu_);
}

// Under mu_: the wait that completes ticket's instance (daemon ring or, with
// kCeTicket, copy-engine ring).
Runtime::Enqueue Runtime::PlanWait(Device& d, uint64_t ticket) {
  Enqueue e;
  e.d = &d;
  e.ce = (ticket & kCeTicket) != 0;
  e.ticket = ticket & ~kCeTicket;
  const TaskInfo& ti = e.ce ? d.ce_info[e.ticket % kCeRing] : d.info[e.ticket % kTaskRing];
  e.trace = cfg_.trace && !e.ce;  // the wait records are per daemon ring entry
  if (e.trace) e.proto = TraceRec{0, ti.key_hash, e.ticket, static_cast<uint32_t>(ti.seq), 0, 0};
  // Copy-engine done words live in host memory: always the polling kernel (the
  // stream memory wait on host memory is not relied on).
  e.kernel_wait = e.trace || e.ce || (cfg_.wait_kernel_bytes >= 0 && ti.msg_bytes >= cfg_.wait_kernel_bytes);
  return e;
}

// Under mu_: matches the instance, fills its descriptor and submits it (daemon
// ring or copy-engine mover); returns the ticket, kCeTicket set for the mover.
uint64_t Runtime::Submit(Device& d, const CollectiveSpec& spec, const std::string& sig, const void* in, void* out) {
  DFCCL_CHECK(spec.self_device == d.ordinal,
              "dfccl: device id " << spec.self_device << " is not local GPU " << d.ordinal
                                  << " (the CUDA backend runs in one process)");
  Comm& c = GetComm(spec.group_devices);
  const uint64_t seq = d.seq[{&c, spec.key_hash}]++;
  const int64_t msg_bytes = spec.elems_per_block * spec.elem_bytes;
  const bool ce = UseCopyEngine(spec, c);
  Instance* inst = Join(c, spec, sig, seq, msg_bytes, ce);
  if (key_names_.find(spec.key_hash) == key_names_.end()) key_names_.emplace(spec.key_hash, spec.key);
  if (ce) {
    const uint64_t ticket = d.ce_next;
    TaskInfo& ti = d.ce_info[ticket % kCeRing];
    DFCCL_CHECK_CODE(ti.done, ErrorCode::kResourceExhausted,
                     "dfccl: more than " << kCeRing << " copy-engine collectives in flight on GPU " << d.ordinal);
    inst->tasks.emplace_back(&d, ticket | kCeTicket);
    inst->started |= 1u << spec.rank;
    ti = TaskInfo{inst, &c, ticket, Clock::now(), false, false, msg_bytes, spec.key_hash, inst->seq};
    d.ce_next = ticket + 1;
    StartCopyEngine(d, c, *inst, spec, in, out, ticket);
    return ticket | kCeTicket;
  }
  const uint64_t ticket = d.next_ticket;
  const uint32_t e = ticket % kTaskRing;
  DFCCL_CHECK_CODE(d.info[e].done, ErrorCode::kResourceExhausted,
                   "dfccl: more than " << kTaskRing << " collectives in flight on GPU " << d.ordinal);
  FillDesc(d, ticket, spec, c, *inst, in, out, msg_bytes);
  inst->tasks.emplace_back(&d, ticket);
  inst->started |= 1u << spec.rank;
  const bool large = msg_bytes >= cfg_.large_threshold;
  d.info[e] = TaskInfo{inst, &c, ticket, Clock::now(), false, large, msg_bytes, spec.key_hash, inst->seq};
  d.pending_large += large ? 1 : 0;
  d.next_ticket = ticket + 1;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  d.host->submitted = ticket + 1;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (large && Running(d) && d.workers < cfg_.large_workers()) {
    d.host->resize = d.launch_id;  // the running daemon quits; a larger one is queued behind it
    Launch(d);
  }
  EnsureRunning(d);
  return ticket;
}

// Outside mu_ (an enqueue on XLA's stream may block while its queue is full):
// the stream-ordered ready write, the done wait, or both.
void Runtime::EnqueueOnStream(cudaStream_t stream, const Enqueue& e, bool ready, bool wait) {
  const auto t0 = Clock::now();
  Device& d = *e.d;
  void* ready_word = e.ce ? const_cast<uint32_t*>(&d.host_dev->ce_ready[e.ticket % kCeRing])
                          : static_cast<void*>(&d.dev->ready[e.ticket % kTaskRing]);
  const uint32_t* done_word = e.ce ? const_cast<const uint32_t*>(&d.host_dev->ce_done[e.ticket % kCeRing])
                                   : &d.dev->done[e.ticket % kTaskRing];
  const uint32_t gen = e.ce ? Gen(e.ticket, kCeRing) : Gen(e.ticket);
  if (ready && wait && !e.kernel_wait) {
    StreamOps::WriteThenWaitGeq32(stream, ready_word, gen, done_word, gen);
  } else {
    if (ready) StreamOps::Write32(stream, ready_word, gen);
    if (wait && e.kernel_wait) {
      const cudaError_t err = LaunchStreamWait(stream, done_word, gen,
                                               e.trace ? d.dev->stream_trace[e.ticket % kTaskRing] : nullptr, e.proto);
      DFCCL_CHECK_CODE(err == cudaSuccess, ::dfccl::ErrorCode::kInternal, "dfccl: done wait kernel on GPU " << d.ordinal << ": " << cudaGetErrorString(err));
    } else if (wait) {
      StreamOps::WaitGeq32(stream, done_word, gen);
    }
  }
  times_.streamop_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

void Runtime::Start(int ordinal, cudaStream_t stream, const CollectiveSpec& spec, const std::string& sig,
                    const void* in, void* out, bool blocking) {
  Enqueue e;
  {
    auto lk = HandlerLock();
    DFCCL_CHECK_CODE(cfg_.configured, ErrorCode::kFailedPrecondition,
                     "dfccl: the GPU runtime was not configured (jax_dfccl._src.backend.load() passes every entry "
                     "of jax_dfccl.config to it)");
    Device& d = GetDevice(ordinal);
    if (!d.error.ok()) d.error.Throw();
    uint64_t ticket = 0;
    try {
      ticket = Submit(d, spec, sig, in, out);
    } catch (const Error& ex) {  // mismatch, a failed instance, a full ring: kept for stats()["errors"]
      RecordError(ex.what());
      throw;
    }
    if (!blocking) d.fifo[spec.site].push_back(ticket);  // Done pairs with it
    e = PlanWait(d, ticket);
  }
  EnqueueOnStream(stream, e, /*ready=*/true, /*wait=*/blocking);
}

void Runtime::Done(int ordinal, cudaStream_t stream, int64_t site) {
  Enqueue e;
  {
    auto lk = HandlerLock();
    Device& d = GetDevice(ordinal);
    if (!d.error.ok()) d.error.Throw();
    auto& q = d.fifo[site];
    DFCCL_CHECK_CODE(!q.empty(), ErrorCode::kFailedPrecondition,
                     "dfccl: dfccl_done at site " << site << " has no pending start");
    e = PlanWait(d, q.front());
    q.pop_front();
  }
  EnqueueOnStream(stream, e, /*ready=*/false, /*wait=*/true);
}

// Hot path (every start): no CUDA call.  A daemon leaves only after storing
// `exiting` (idle/stall quit, Dekker with `submitted`) or when the host asked it
// to (resize, and then a successor is already queued).
bool Runtime::Running(Device& d) { return d.launched && d.host->exiting != d.launch_id; }

// The daemon kernel has not returned yet (for stats: it may still be on its way out).
bool Runtime::Alive(Device& d) { return d.launched && cudaEventQuery(d.ev) == cudaErrorNotReady; }

void Runtime::Launch(Device& d) {
  DeviceGuard guard(d.ordinal);
  d.launch_id++;
  d.workers = d.pending_large > 0 ? cfg_.large_workers() : cfg_.workers();
  DaemonParams p{};
  p.dev = d.dev;
  p.host = d.host_dev;
  p.launch_id = d.launch_id;
  p.workers = d.workers;
  p.spin_ns = cfg_.spin_ns();
  p.sticky_max = cfg_.sticky_max();
  p.trace = cfg_.trace ? 1 : 0;
  p.idle_ns = cfg_.idle_ns();
  p.stall_ns = cfg_.stall_ns();
  busy_in_ = "a daemon launch";
  cudaError_t err = LaunchDaemon(p, d.stream);
  if (err == cudaSuccess) err = cudaEventRecord(d.ev, d.stream);
  busy_in_ = "nothing known";
  DFCCL_CHECK_CODE(err == cudaSuccess, ::dfccl::ErrorCode::kInternal, "dfccl: daemon launch on GPU " << d.ordinal << ": " << cudaGetErrorString(err));
  d.launched = true;
  d.launches++;
}

void Runtime::EnsureRunning(Device& d) {
  if (!Running(d)) Launch(d);
}

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
          if (d->error.ok()) d->error = Status::Of(ex);
        } catch (const std::exception& ex) {
          if (d->error.ok()) d->error = Status{ErrorCode::kInternal, ex.what()};
        }
      }
      if (std::string e = ce_.error(); !e.empty())
        for (auto& [ord, d] : devices_)
          if (d->error.ok()) d->error = Status{ErrorCode::kInternal, e};
      for (auto& [ord, d] : devices_) busy = busy || d->oldest < d->next_ticket;
    }
    // Short sleeps while collectives are pending (slots recycle promptly), longer when idle.
    std::this_thread::sleep_for(std::chrono::microseconds(busy ? 20 : 100));
  }
}

void Runtime::PollDevice(Device& d, Clock::time_point now) {
  PollRing(d, d.info, d.oldest, d.next_ticket, d.host->done, now);
  PollRing(d, d.ce_info, d.ce_oldest, d.ce_next, d.host->ce_done, now);
  if (d.oldest >= d.next_ticket) { d.backoff_us = 20; return; }
  if (!Running(d) && now >= d.next_relaunch) {
    Launch(d);
    d.backoff_us = std::min<int64_t>(d.backoff_us * 2, static_cast<int64_t>(cfg_.relaunch_max_us));
    d.next_relaunch = now + std::chrono::microseconds(d.backoff_us);
  }
}

// Completions of one ticket ring (daemon or copy engine), then the watchdog.
template <size_t N>
void Runtime::PollRing(Device& d, std::array<TaskInfo, N>& info, uint64_t& oldest, uint64_t next,
                       const volatile uint32_t* done, Clock::time_point now) {
  for (uint64_t t = oldest; t < next; ++t) {
    TaskInfo& ti = info[t % N];
    if (!ti.done && done[t % N] == Gen(t, N)) {
      ti.done = true;
      (ti.inst && ti.inst->failed ? d.failed : d.completed)++;
      d.pending_large -= ti.large ? 1 : 0;
      OnTaskDone(d, ti);
    }
  }
  while (oldest < next && info[oldest % N].done) oldest++;
  if (oldest >= next) return;
  const auto limit = std::chrono::duration<double>(cfg_.timeout_s);
  // Tickets are submitted in order, so the oldest pending one is the first to time out:
  // the watchdog scan (under the lock every handler needs) runs only once it has.
  if (now - info[oldest % N].t <= limit) return;
  for (uint64_t t = oldest; t < next; ++t) {
    TaskInfo& ti = info[t % N];
    if (!ti.done && ti.inst && !ti.inst->failed && now - ti.t > limit) {
      std::ostringstream why;
      why << "timed out after " << cfg_.timeout_s << " s: ";
      std::vector<int> missing;
      for (int r = 0; r < ti.inst->nranks; ++r)
        if (!(ti.inst->started & (1u << r))) missing.push_back(r);
      if (missing.empty() && ti.inst->ce) {
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
      } else if (missing.empty()) {
        why << "every rank started it but it did not complete";
      } else {
        why << "rank(s) [";
        for (size_t i = 0; i < missing.size(); ++i)
          why << (i ? ", " : "") << missing[i] << " (GPU " << ti.comm->ordinals[missing[i]] << ")";
        why << "] never started it";
      }
      Abort(*ti.comm, *ti.inst, ErrorCode::kDeadlineExceeded, why.str());
    }
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
  ReleaseSlot(*c, *inst);
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

void Runtime::Abort(Comm& c, Instance& inst, ErrorCode code, const std::string& why) {
  inst.failed = true;
  std::ostringstream msg;
  msg << "dfccl: collective '" << inst.key << "' (sequence " << inst.seq << ", group of GPUs [";
  for (int i = 0; i < c.n; ++i) msg << (i ? "," : "") << c.ordinals[i];
  msg << "]) " << why;
  RecordError(msg.str());
  for (int ord : c.ordinals) {
    Device& d = *devices_[ord];
    if (d.error.ok()) d.error = Status{code, msg.str()};
  }
  // Copy-engine instances: once issued, their copies complete on their own (all
  // inputs were ready); otherwise the host releases the ranks' done waits.
  const bool all_started = inst.started == (1u << c.n) - 1;
  const bool release_ce = inst.ce && (!all_started || ce_.Cancel(&c, inst.key_hash, inst.seq));
  for (auto& [d, tagged] : inst.tasks) {
    const uint64_t ticket = tagged & ~kCeTicket;
    if (tagged & kCeTicket) {
      if (!release_ce) continue;
      d->host->ce_done[ticket % kCeRing] = Gen(ticket, kCeRing);  // Abort set the devices' error above
      continue;
    }
    reinterpret_cast<volatile int32_t&>(d->host->desc[ticket % kTaskRing].abort) = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    d->host->abort_gen = d->host->abort_gen + 1;
    EnsureRunning(*d);
  }
  if (inst.slot < 0 && !inst.ce) ReleaseSlot(c, inst);  // leave the waiting queue
}

// Under mu_.
void Runtime::RecordError(const std::string& message) {
  errors_.push_back(message);
  if (errors_.size() > kMaxErrors) errors_.erase(errors_.begin());
}

Config Runtime::config() {
  std::lock_guard lk(mu_);
  return cfg_;
}

void Runtime::Configure(const std::map<std::string, double>& kv) {
  std::lock_guard lk(mu_);
  cfg_.Apply(kv);
  timeout_s_ = cfg_.timeout_s;
  ce_.Configure(CeSettings{cfg_.copy_engine_chunk_bytes, cfg_.copy_engine_blocks, cfg_.copy_engine_push});
}

std::map<std::string, double> Runtime::Stats(std::vector<std::string>* errors) {
  std::lock_guard lk(mu_);
  std::map<std::string, double> s;
  double started = 0, completed = 0, failed = 0, preempts = 0, resumes = 0, steps = 0, aborted = 0, launches = 0;
  double relaunches = 0, daemon_done = 0, trace_records = 0;
  double dev_bytes = 0, host_bytes = 0, running = 0, live = 0, slots_used = 0, waiting = 0;
  for (auto& [ord, d] : devices_) {
    started += d->next_ticket + d->ce_next;
    completed += d->completed;
    failed += d->failed;
    std::vector<BlockStats> rows(kMaxBlocks);
    CopyOut(*d, rows.data(), d->dev->stats, sizeof(BlockStats) * kMaxBlocks);
    for (int b = 0; b < kMaxBlocks; ++b) {
      const BlockStats& bs = rows[b];
      daemon_done += bs.tasks_done;
      trace_records += std::min<uint64_t>(bs.trace_head, kTracePerBlock);
      preempts += bs.preempts;
      resumes += bs.resumes;
      steps += bs.steps;
      aborted += bs.aborted;
    }
    launches += d->launches;
    relaunches += d->launches > 0 ? d->launches - 1 : 0;
    dev_bytes += sizeof(DeviceShared);
    host_bytes += sizeof(HostShared);
    running += Alive(*d) ? 1 : 0;
  }
  for (auto& [name, c] : comms_) {
    dev_bytes += c->bytes;
    live += c->live.size();
    for (int p = 0; p < kNumPools; ++p) {
      slots_used += c->view.pool[p].nslots - static_cast<double>(c->free_slots[p].size());
      waiting += c->waiting[p].size();
    }
  }
  // The keys common to every backend (docs/architecture.md, "stats() keys"), then the GPU extras.
  s["started"] = started;
  s["completed"] = completed;
  s["failed"] = failed;
  s["pending"] = started - completed - failed;
  s["preemptions"] = preempts;
  s["resumes"] = resumes;
  s["communicators"] = static_cast<double>(comms_.size());
  s["instances_live"] = live;
  s["trace_records"] = trace_records;
  s["daemon_tasks_done"] = daemon_done;
  s["steps"] = steps;
  s["aborted"] = aborted;
  s["launches"] = launches;
  s["relaunches"] = relaunches;
  s["bytes_held"] = dev_bytes;
  s["host_bytes_held"] = host_bytes;
  double sms = 0;
  for (auto& [ord, d] : devices_) sms = std::max<double>(sms, d->launched ? d->workers + 1 : 0);
  s["sms_used"] = sms;                      // blocks of the latest daemon (max over devices)
  s["sms_default"] = cfg_.workers() + 1;
  s["sms_large"] = cfg_.large_workers() + 1;
  s["daemons_running"] = running;
  s["devices"] = static_cast<double>(devices_.size());
  s["slots_in_use"] = slots_used;
  s["instances_waiting_for_slot"] = waiting;
  s["copy_engine_ops"] = static_cast<double>(ce_.issued());  // instances moved by the copy engines
  s["copy_engine_issue_us"] = ce_.issue_s() * 1e6;          // host time enqueueing them (all ranks), total
  s["copy_engine_gpu_us"] = ce_.gpu_s() * 1e6;              // rank 0's GPU time, first copy .. done, total
  s["copy_engine_timed"] = static_cast<double>(ce_.timed()); // ... over this many of them
  const auto per = [](int64_t ns, int64_t n) { return n > 0 ? static_cast<double>(ns) / n / 1e3 : 0.0; };
  s["host_start_us"] = per(times_.start_ns, times_.starts);
  s["host_done_us"] = per(times_.done_ns, times_.dones);
  s["host_streamop_us"] = per(times_.streamop_ns, times_.starts + times_.dones);
  s["host_gap_us"] = per(times_.gap_ns, times_.gaps);
  if (errors) *errors = errors_;
  return s;
}

std::vector<TraceOut> Runtime::Trace() {
  static const char* kNames[kNumTraceEvents] = {"start",  "run",   "preempt",     "resume",
                                                "finish", "error", "stream_wait", "stream_woke"};
  std::lock_guard lk(mu_);
  std::vector<TraceOut> out;
  for (auto& [ord, d] : devices_) {
    std::vector<BlockStats> rows(kMaxBlocks);
    CopyOut(*d, rows.data(), d->dev->stats, sizeof(BlockStats) * kMaxBlocks);
    std::vector<TraceRec> ring(static_cast<size_t>(kMaxBlocks) * kTracePerBlock);
    CopyOut(*d, ring.data(), d->dev->trace, ring.size() * sizeof(TraceRec));
    for (int b = 0; b < kMaxBlocks; ++b) {
      const uint64_t head = rows[b].trace_head;
      const uint64_t first = head > kTracePerBlock ? head - kTracePerBlock : 0;
      for (uint64_t i = first; i < head; ++i) {
        const TraceRec& r = ring[static_cast<size_t>(b) * kTracePerBlock + i % kTracePerBlock];
        auto k = key_names_.find(r.key_hash);
        out.push_back(TraceOut{ord, k != key_names_.end() ? k->second : std::to_string(r.key_hash), r.seq,
                               r.event < kNumTraceEvents ? kNames[r.event] : "?", r.t_ns});
      }
    }
    std::vector<TraceRec> waits(static_cast<size_t>(kTaskRing) * 2);
    CopyOut(*d, waits.data(), d->dev->stream_trace, waits.size() * sizeof(TraceRec));
    for (const TraceRec& r : waits) {
      if (r.t_ns == 0) continue;
      auto k = key_names_.find(r.key_hash);
      out.push_back(TraceOut{ord, k != key_names_.end() ? k->second : std::to_string(r.key_hash), r.seq,
                             r.event < kNumTraceEvents ? kNames[r.event] : "?", r.t_ns});
    }
  }
  std::sort(out.begin(), out.end(), [](const TraceOut& a, const TraceOut& b) { return a.t_ns < b.t_ns; });
  return out;
}

void Runtime::Reset() {
  std::lock_guard lk(mu_);
  errors_.clear();
  for (auto& [ord, d] : devices_) {
    d->error = Status{};
    d->seq.clear();
    d->fifo.clear();
  }
  for (auto& [name, c] : comms_) c->failed.clear();
}

}  // namespace dfccl::gpu
