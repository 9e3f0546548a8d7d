// The daemon path's handlers (a call site's setup, the submit and done kernels),
// the daemon's launch, and the module's configure/stats/trace/reset.  The proxy
// thread is in proxy.cc, the copy-engine path's host side in copy_engine_path.cc.
#include "runtime/runtime.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "dfccl/host.h"
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

// The static part of a call site's task (everything but ticket, sequence, buffers, slot).
TaskDesc Runtime::SiteDesc(const CollectiveSpec& spec, const Comm& c, int64_t msg_bytes, int key_ctr) {
  TaskDesc t{};
  // Pool 0 (LL protocol) takes messages whose lanes fit one LL chunk (8 data
  // bytes per 16-byte line) and are 16-byte multiples; the rest use pool 1.
  const PoolGeom& small = c.view.pool[0];
  const auto plan0 = LanePlan(msg_bytes, small, cfg_.workers(), cfg_.lane_min_bytes);
  // ragged_all_to_all needs the peers' addresses: the direct path of pool 1 only.
  const bool direct_only = spec.kind == OpKind::kRaggedAllToAll;
  DFCCL_CHECK_CODE(!direct_only || c.direct, ErrorCode::kFailedPrecondition,
                   "dfccl: ragged_all_to_all '" << spec.key << "' needs the direct path (peer access between the GPUs)");
  const int pool = (!direct_only && cfg_.ll && msg_bytes % 16 == 0 && plan0.second * 2 <= small.chunk_bytes) ? 0 : 1;
  const PoolGeom& g = c.view.pool[pool];
  const int workers = msg_bytes >= cfg_.large_threshold ? cfg_.large_workers() : cfg_.workers();
  const bool direct = c.direct && pool == 1;
  const int64_t unit = direct ? DirectUnitBytes(static_cast<int32_t>(spec.kind), msg_bytes, spec.nranks) : msg_bytes;
  auto [lanes, lane_bytes] = LanePlan(unit, g, workers, cfg_.lane_min_bytes);
  if (direct) {  // lane_bytes becomes the chunk: small enough that every lane gets one, at most kDirectChunk
    const int64_t per_lane = ((unit + lanes - 1) / lanes + 15) / 16 * 16;
    lane_bytes = std::clamp<int64_t>(per_lane, std::min<int64_t>(4096, kDirectChunk), kDirectChunk);
    lanes = static_cast<int>(std::min<int64_t>(lanes, (unit + lane_bytes - 1) / lane_bytes));
  }
  t.key_hash = spec.key_hash;
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
  t.pool = pool;
  t.lanes = lanes;
  t.vec = msg_bytes % 16 == 0;  // and both buffers 16-byte aligned (the submit kernel checks)
  // Pool 0 of a communicator that matches by identity: the key's bucket of slots
  // (the submit kernel derives the tag from (key, sequence); device/task.h, "identity").
  const bool identity = pool == 0 && c.view.identity;
  t.slot = identity ? IdentityBucket(spec.key_hash, c.view.pool[0].nslots) : -1;
  t.match = identity ? kMatchIdentity : -1;
  t.direct = direct ? 1 : 0;
  t.sig_hash = 0;
  t.key_ctr = key_ctr;
  return t;
}

bool Runtime::UseCopyEngine(OpKind kind, int nranks, int64_t bytes) const {
  const bool reduction = Reduces(kind);
  return cfg_.copy_engine_min_bytes >= 0 && bytes >= cfg_.copy_engine_min_bytes && nranks > 1 &&
         (!reduction || bytes >= cfg_.copy_engine_reduce_min_bytes) && CopyEngine::Supports(kind, nranks);
}

bool Runtime::UsesCopyEngine(OpKind kind, int nranks, int64_t in_bytes, int64_t out_bytes) {
  std::lock_guard lk(mu_);
  if (!ordinal_of_.empty()) return false;  // across processes: the daemon path (the mover needs peer access)
  return UseCopyEngine(kind, nranks, std::max(in_bytes, out_bytes));
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

namespace {
// Relaxed stream-capture mode for this thread while in scope: a handler called
// while XLA records a command buffer may set up devices and communicators
// (allocations, copies on the runtime's own streams), which the capture's
// default mode would refuse.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};
}  // namespace

namespace {
// A start form's slots and their header (device/task.h, "staged"): runtime
// memory on the site's GPU, exportable when the direct path reaches it from
// other processes (then tagged once, like a range of XLA's memory).
void MakeStage(Site& s, Comm& c, Device& d, Ipc& ipc, int64_t in_bytes, int64_t out_bytes) {
  auto lines = [](int64_t b) { return (std::max<int64_t>(b, 16) + 255) / 256 * 256; };
  const int64_t head = lines(sizeof(SiteStage)), out_off = lines(in_bytes), slot_bytes = out_off + lines(out_bytes);
  const int64_t bytes = head + kStageSlots * slot_bytes;
  DeviceGuard guard(d.ordinal);
  const bool shared = c.cross_process && s.desc.direct;
  char* base = nullptr;
  if (shared) {
    std::vector<int> local;
    for (int o : c.ordinals)
      if (o >= 0) local.push_back(o);
    base = reinterpret_cast<char*>(Vmm::Create(static_cast<uint64_t>(bytes), d.ordinal, local).va);
  } else {
    DFCCL_CHECK_CUDA(cudaMalloc(&base, bytes), "dfccl: staging of start form '" << s.key << "'");
  }
  DFCCL_CHECK_CUDA(cudaMemsetAsync(base, 0, head, d.aux), "dfccl: staging of start form '" << s.key << "'");
  DFCCL_CHECK_CUDA(cudaStreamSynchronize(d.aux), "dfccl: staging of start form '" << s.key << "'");
  s.stage.state = reinterpret_cast<SiteStage*>(base);
  s.stage.out_off = out_off;
  const int tag = shared ? ipc.Tag(base, d.ordinal) : 0;
  for (int k = 0; k < kStageSlots; ++k) {
    s.stage.slot[k] = base + head + k * slot_bytes;
    s.stage.tags[k] = DirectTags(tag, tag);
  }
  s.staged = true;
  s.in_bytes = in_bytes;
  s.out_bytes = out_bytes;
  c.bytes += bytes;
}
}  // namespace

const Site* Runtime::Prepare(int ordinal, const CollectiveSpec& spec, const std::string& sig, bool staged,
                             int64_t in_bytes, int64_t out_bytes) {
  // A group spanning processes whose memory exchange is still under way (Python
  // imports the peers' handles on a thread, jax_dfccl/_src/distributed.py): wait
  // for it, without the lock (the import takes it), at most timeout_s.
  for (auto t0 = Clock::now();;) {
    {
      auto lk = HandlerLock();
      auto it = comms_.find(spec.group_devices);
      if (it == comms_.end() || it->second->ready) break;
    }
    if (Clock::now() - t0 > std::chrono::duration<double>(timeout_s_.load())) break;  // GetComm names it
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  auto lk = HandlerLock();
  RelaxedCapture relaxed;
  DFCCL_CHECK_CODE(cfg_.configured, ErrorCode::kFailedPrecondition,
                   "dfccl: the GPU runtime was not configured (jax_dfccl._src.backend.load() passes every entry "
                   "of jax_dfccl.config to it)");
  DFCCL_CHECK(spec.self_device == GlobalOf(ordinal),
              "dfccl: device id " << spec.self_device << " is not local GPU " << ordinal);
  Device& d = GetDevice(ordinal);
  if (!d.error.ok()) ThrowDeviceError(d);
  Comm& c = GetComm(spec.group_devices);
  auto kc = d.key_ctr.find({&c, spec.key_hash});
  if (kc == d.key_ctr.end()) {
    DFCCL_CHECK_CODE(d.key_ctr.size() < static_cast<size_t>(kMaxKeys), ErrorCode::kResourceExhausted,
                     "dfccl: more than " << kMaxKeys << " collective keys on GPU " << ordinal);
    kc = d.key_ctr.emplace(std::make_pair(&c, spec.key_hash), static_cast<int>(d.key_ctr.size())).first;
  }
  const int64_t msg_bytes = spec.elems_per_block * spec.elem_bytes;
  auto site = std::make_unique<Site>();
  site->index = static_cast<int>(d.sites.size());
  site->d = &d;
  site->c = &c;
  site->key = spec.key;
  site->signature = sig;
  site->key_hash = spec.key_hash;
  site->rank = spec.rank;
  site->msg_bytes = msg_bytes;
  site->large = msg_bytes >= cfg_.large_threshold;
  TaskDesc t = SiteDesc(spec, c, msg_bytes, kc->second);
  // One lane only: a block that runs several lanes in turn is slower than the
  // daemon's blocks in parallel (measured: 64 KiB, 8 lanes, 4x slower on an H200).
  site->ll = t.pool == 0 && t.lanes == 1;
  site->tagged = c.cross_process && t.direct && !staged;  // a staged site's slots are tagged once (MakeStage)
  site->identity = t.match == kMatchIdentity;
  // Who sends to this rank: the peer it receives from for ppermute and broadcast
  // (recv_from, also the root), every other rank for the rest (the lanes' RecvsFrom).
  const bool one_source = spec.kind == OpKind::kPermute || spec.kind == OpKind::kBroadcast;
  for (int r = 0; r < spec.nranks; ++r)
    if (r != spec.rank && (!one_source || r == spec.recv_from)) site->senders |= 1u << r;
  if (site->ll) site->inline_kernel = InlineSubmitKernelFor(t.kind, t.dtype, t.reduce);
  t.site = site->index;
  t.sig_hash = HashString(sig);
  if (static_cast<uint32_t>(t.sig_hash) == 0) t.sig_hash |= 1;  // low bits 0: a failed sender's header (protocol "identity")
  site->desc = t;
  if (staged) MakeStage(*site, c, d, ipc_, in_bytes, out_bytes);
  if (key_names_.find(spec.key_hash) == key_names_.end()) key_names_.emplace(spec.key_hash, spec.key);
  d.sites.push_back(std::move(site));
  EnsureRunning(d);
  return d.sites.back().get();
}

// What the kernels of one call need to know: inside a command buffer (no handler
// will report a failure: trap), tracing, the bound of their waits.
Runtime::KernelFlags Runtime::FlagsFor(cudaStream_t stream) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  DFCCL_CHECK_CUDA(cudaStreamIsCapturing(stream, &cap), "dfccl: stream capture state");
  return KernelFlags{cap != cudaStreamCaptureStatusNone ? 1 : 0, trace_.load(std::memory_order_relaxed) ? 1 : 0,
                     static_cast<int64_t>((2 * timeout_s_.load(std::memory_order_relaxed) + 10) * 1e9)};
}

// A kernel launch, its host time counted (stats()["cuda"]["host_streamop_us"]).
template <class F>
void Runtime::Timed(Device& d, const char* what, F&& launch) {
  const auto t0 = Clock::now();
  const cudaError_t err = launch();
  DFCCL_CHECK_CODE(err == cudaSuccess, ErrorCode::kInternal,
                   "dfccl: " << what << " kernel on GPU " << d.ordinal << ": " << cudaGetErrorString(err));
  times_.streamop_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

void Runtime::ThrowIfFailed(Device& d) {
  if (!d.has_error.load(std::memory_order_acquire)) return;
  auto lk = HandlerLock();
  if (!d.error.ok()) ThrowDeviceError(d);
}

void Runtime::RaiseIfFailed() {
  auto lk = HandlerLock();
  const auto now = Clock::now();
  for (auto& [ord, d] : devices_) PollDevice(*d, now);
  for (auto& [ord, d] : devices_)
    if (!d->error.ok()) ThrowDeviceError(*d);
}

void Runtime::ThrowDeviceError(Device& d) {
  const Status e = d.error;
  if (d.error_once) {
    d.error = Status{};
    d.error_once = false;
    d.has_error.store(false, std::memory_order_release);
  }
  e.Throw();
}

// The hot path: one kernel launch; the lock only when the daemon must be (re)launched.
void Runtime::Submit(cudaStream_t stream, const Site& site, const void* in, void* out, int64_t* ticket_out,
                     bool blocking, const void* init) {
  Device& d = *site.d;
  ThrowIfFailed(d);
  const KernelFlags f = FlagsFor(stream);
  SubmitParams p{};
  p.task = site.desc;
  p.dev = d.dev;
  p.host = d.host_dev;
  p.in = static_cast<const char*>(in);
  p.out = static_cast<char*>(out);
  p.ticket_out = ticket_out;
  p.site = site.index;
  p.wait = blocking ? 1 : 0;
  if (site.tagged) {  // the direct path across processes: the ranges that hold in and out (runtime/ipc.h)
    try {
      p.tags = DirectTags(ipc_.Tag(in, d.ordinal), ipc_.Tag(out, d.ordinal));
    } catch (const Error& e) {
      throw Error("dfccl: collective '" + site.key + "' (rank " + std::to_string(site.rank) + "): its buffers cannot "
                  "be shared with the other processes of its group (" + e.what() + "); an operand XLA did not "
                  "allocate, such as a constant, cannot be either: compute it inside the program, or set "
                  "jax_dfccl.config.tuning.direct = False (the staged path) before the group's first program is lowered", e.code());
    }
  }
  p.trap = f.trap;
  p.trace = f.trace;
  p.timeout_ns = f.timeout_ns;
  if (blocking && site.ll) {  // the submit kernel may run it itself (device/task.h, "inline")
    p.inline_ns = inline_ns_.load(std::memory_order_relaxed);
    p.inline_kernel = site.inline_kernel;
    p.spin_ns = spin_ns_.load(std::memory_order_relaxed);
    p.sticky_max = sticky_max_.load(std::memory_order_relaxed);
  }
  if (site.staged) {  // the operand into the call's slot first (device/task.h, "staged")
    StageParams sp{};
    sp.stage = site.stage;
    sp.dev = d.dev;
    sp.in = static_cast<const char*>(in);
    sp.init = static_cast<const char*>(init);
    sp.in_bytes = site.in_bytes;
    sp.out_bytes = site.out_bytes;
    Timed(d, "stage", [&] { return LaunchStage(sp, stream); });
    p.stage = site.stage;
  }
  Timed(d, "submit", [&] { return LaunchSubmit(p, stream, pdl_.load(std::memory_order_relaxed)); });
  // The proxy relaunches a daemon that quit once it sees the record; a call
  // outside a command buffer does it at once (and grows the grid for a large one).
  if (!p.trap && (!Running(d) || (site.large && d.workers < large_workers_.load(std::memory_order_relaxed)))) {
    auto lk = HandlerLock();
    RelaxedCapture relaxed;
    if (site.large) d.pending_large++;  // released by the proxy when it sees the record
    if (site.large && Running(d) && d.workers < cfg_.large_workers()) {
      d.host->resize = d.launch_id;  // the running daemon quits; a larger one is queued behind it
      Launch(d);
    }
    EnsureRunning(d);
    if (site.large) d.pending_large--;
  }
}

void Runtime::Finish(int ordinal, cudaStream_t stream, const int64_t* ticket, const Site* staged, void* result) {
  Device& d = GetDeviceFast(ordinal);
  ThrowIfFailed(d);
  const KernelFlags f = FlagsFor(stream);
  DoneParams p{};
  p.dev = d.dev;
  p.ticket = ticket;
  p.trap = f.trap;
  p.trace = f.trace;
  p.timeout_ns = f.timeout_ns;
  if (staged != nullptr && staged->staged) {  // the done kernel fills the result from the call's slot
    p.stage = staged->stage;
    p.result = static_cast<char*>(result);
    p.out_bytes = staged->out_bytes;
  }
  Timed(d, "done", [&] { return LaunchDone(p, stream, pdl_.load(std::memory_order_relaxed)); });
}

// No CUDA call.  A daemon leaves only after storing `exiting` (idle/stall quit;
// the proxy relaunches it when a submit kernel's record arrives) or when the host
// asked it to (resize, and then a successor is already queued).
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
  p.map_gen = d.map_gen = ipc_.gen();  // before the launch: every range mapped so far is older than it
  busy_in_ = "a daemon launch";
  cudaError_t err = LaunchDaemon(p, d.stream);
  if (err == cudaSuccess) err = cudaEventRecord(d.ev, d.stream);
  busy_in_ = "nothing known";
  DFCCL_CHECK_CODE(err == cudaSuccess, ::dfccl::ErrorCode::kInternal, "dfccl: daemon launch on GPU " << d.ordinal << ": " << cudaGetErrorString(err));
  d.launched = true;
  d.launches++;
  d.blocks_launched += p.workers + 1;
}

void Runtime::EnsureRunning(Device& d) {
  if (!Running(d)) Launch(d);
}

// Under mu_.  Also printed at once: inside a command buffer the collective's
// kernel then traps, and the process may end before any exception carries it.
void Runtime::RecordError(const std::string& message) {
  static int printed = 0;  // (a failed group can fail hundreds of pending instances at once)
  if (printed < 8) std::fprintf(stderr, "%s\n", message.c_str());
  else if (printed == 8) std::fprintf(stderr, "dfccl: more errors: jax_dfccl.stats()['cuda']['errors']\n");
  printed++;
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
  trace_ = cfg_.trace;
  if (cfg_.configured) {
    large_workers_ = cfg_.large_workers();
    inline_ns_ = cfg_.inline_ns();
    spin_ns_ = cfg_.spin_ns();
    sticky_max_ = cfg_.sticky_max();
    pdl_ = cfg_.submit_pdl;
  }
  ce_.Configure(CeSettings{cfg_.copy_engine_chunk_bytes, cfg_.copy_engine_blocks, cfg_.copy_engine_push});
}

std::map<std::string, double> Runtime::Stats(std::vector<std::string>* errors) {
  std::lock_guard lk(mu_);
  std::map<std::string, double> s;
  double started = 0, completed = 0, failed = 0, preempts = 0, resumes = 0, steps = 0, aborted = 0, launches = 0;
  double relaunches = 0, daemon_done = 0, trace_records = 0, inline_done = 0, identity_done = 0;
  double dev_bytes = 0, host_bytes = 0, running = 0, live = 0, slots_used = 0, waiting = 0;
  std::set<std::tuple<Comm*, uint64_t, uint64_t>> pending_instances;
  // After a kernel trapped (a failure inside a command buffer) the CUDA context is
  // gone: the device's counters count as 0 and the reason joins the errors.
  std::vector<std::string> unreadable;
  const auto read = [&](Device& dv, void* dst, const void* src, size_t n) {
    try {
      CopyOut(dv, dst, src, n);
      return true;
    } catch (const Error& e) {
      std::memset(dst, 0, n);
      unreadable.push_back(std::string(e.what()) + " (GPU " + std::to_string(dv.ordinal) + ")");
      return false;
    }
  };
  for (auto& [ord, d] : devices_) {
    PollRecords(*d, Clock::now());  // every record written before a done the caller saw
    started += d->seen + d->ce_next;
    std::vector<TaskRun> runs(kTaskRing);
    if (d->oldest < d->seen) read(*d, runs.data(), d->dev->run, sizeof(TaskRun) * kTaskRing);
    for (uint64_t t = d->oldest; t < d->seen; ++t) {
      const TaskInfo& ti = d->info[t % kTaskRing];
      if (ti.done || !ti.comm) continue;
      pending_instances.insert({ti.comm, ti.key_hash, ti.seq});
      waiting += runs[t % kTaskRing].phase == 1 ? 1 : 0;
    }
    completed += d->completed;
    failed += d->failed;
    struct {  // DeviceShared::stats, inline_done and identity_done, adjacent: one copy
      BlockStats rows[kMaxBlocks];
      unsigned long long inline_done, identity_done;
    } counters;
    static_assert(offsetof(DeviceShared, inline_done) == offsetof(DeviceShared, stats) + sizeof(BlockStats) * kMaxBlocks);
    static_assert(offsetof(DeviceShared, identity_done) == offsetof(DeviceShared, inline_done) + sizeof(uint64_t));
    read(*d, &counters, d->dev->stats, sizeof(counters));
    const BlockStats* rows = counters.rows;
    // Identity tasks finished inline never had a ticket: started and completed at once.
    inline_done += static_cast<double>(counters.inline_done + counters.identity_done);
    identity_done += static_cast<double>(counters.identity_done);
    started += static_cast<double>(counters.identity_done);
    completed += static_cast<double>(counters.identity_done);
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
  live += static_cast<double>(pending_instances.size());
  for (auto& [name, c] : comms_) {
    dev_bytes += c->bytes;
    live += c->live.size();
    unsigned long long bits[kNumPools][kMaxPoolSlots / 64];
    if (!c->ready) continue;
    if (!read(*devices_[c->io_ordinal], bits, c->table->free_bits, sizeof(bits))) continue;
    for (int p = 0; p < kNumPools; ++p) {
      const int n = c->view.pool[p].nslots;
      int free = 0;
      for (int i = 0; i < n; ++i) free += (bits[p][i / 64] >> (i % 64)) & 1;
      slots_used += n - free;
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
  s["inline_done"] = inline_done;
  s["identity_done"] = identity_done;
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
  s["host_calls"] = static_cast<double>(times_.starts + times_.dones);
  s["ranges_exported"] = static_cast<double>(ipc_.exported());  // allocations shared with other processes
  s["ranges_mapped"] = static_cast<double>(ipc_.mapped());      // other processes' allocations mapped here
  if (errors) {
    *errors = errors_;
    for (auto& e : ipc_.errors()) errors->push_back(e);
    std::sort(unreadable.begin(), unreadable.end());
    unreadable.erase(std::unique(unreadable.begin(), unreadable.end()), unreadable.end());
    errors->insert(errors->end(), unreadable.begin(), unreadable.end());
  }
  return s;
}

std::vector<TraceOut> Runtime::Trace() {
  const auto& kNames = kTraceEventNames;
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
    std::vector<TraceRec> waits(static_cast<size_t>(kTaskRing) * kNumStreamEvents);
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

// Tests call it after an injected fault, with nothing in flight: every
// sequence number restarts at 0 (on the host for the copy-engine path, on the
// devices for the daemon path) and the match tables start empty.
void Runtime::Reset() {
  std::lock_guard lk(mu_);
  errors_.clear();
  for (auto& [ord, d] : devices_) {
    d->error = Status{};
    d->error_once = false;
    d->has_error.store(false);
    d->seq.clear();
    d->fifo.clear();
    DeviceGuard guard(d->ordinal);
    cudaError_t e = cudaMemsetAsync(d->dev->seq_ctr, 0, sizeof(d->dev->seq_ctr), d->aux);
    if (e == cudaSuccess) e = cudaStreamSynchronize(d->aux);
    DFCCL_CHECK_CODE(e == cudaSuccess, ErrorCode::kInternal, "dfccl: reset on GPU " << d->ordinal << ": " << cudaGetErrorString(e));
  }
  for (auto& [name, c] : comms_) {
    c->failed.clear();
    c->reported.clear();
    if (c->ready && c->ordinals[0] >= 0) InitTable(*c);  // the table's owner (rank 0's process) resets it
  }
}

}  // namespace dfccl::gpu
