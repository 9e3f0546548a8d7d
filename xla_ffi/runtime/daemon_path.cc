// The daemon path's host side (daemon_path.h): a call site's setup (Prepare,
// SiteDesc), the submit and done kernels' launches (Submit, Finish), the submit
// kernels' records (PollRecords), the failures the device decided
// (OnDaemonTaskDone) and the watchdog's reads and abort (ReadEntry,
// IdentityArrived, AbortDaemonInstance; called by the proxy).
// Owns DaemonPath::PerDevice.  Lock: Prepare takes Context::mu (HandlerLock);
// Submit and Finish run without it except to (re)launch the daemon; the rest
// runs under it (the proxy's or the facade's caller holds it).
#include "runtime/daemon_path.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <sstream>
#include <thread>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "dfccl/host.h"
#include "runtime/communicator.h"
#include "runtime/driver.h"
#include "runtime/proxy.h"

namespace dfccl::gpu {

// The static part of a call site's task (everything but ticket, sequence, buffers, slot).
TaskDesc DaemonPath::SiteDesc(const CollectiveSpec& spec, const Communicator& c, int64_t msg_bytes, int key_ctr) {
  TaskDesc t{};
  // Pool 0 (LL protocol) takes messages whose lanes fit one LL chunk (8 data
  // bytes per 16-byte line) and are 16-byte multiples; the rest use pool 1.
  const PoolGeom& small = c.view.pool[0];
  const auto plan0 = LanePlan(msg_bytes, small, ctx_.cfg.workers(), ctx_.cfg.lane_min_bytes);
  // ragged_all_to_all needs the peers' addresses: the direct path of pool 1 only.
  const bool direct_only = spec.kind == OpKind::kRaggedAllToAll;
  DFCCL_CHECK_CODE(!direct_only || c.direct, ErrorCode::kFailedPrecondition,
                   "dfccl: ragged_all_to_all '" << spec.key << "' needs the direct path (peer access between the GPUs)");
  const int pool = (!direct_only && ctx_.cfg.ll && msg_bytes % 16 == 0 && plan0.second * 2 <= small.chunk_bytes) ? 0 : 1;
  const PoolGeom& g = c.view.pool[pool];
  const int workers = msg_bytes >= ctx_.cfg.large_threshold ? ctx_.LargeWorkers(ctx_.GetDevice(c.ordinals[spec.rank]))
                                                             : ctx_.cfg.workers();
  const bool direct = c.direct && pool == 1;
  const int64_t unit = direct ? DirectUnitBytes(static_cast<int32_t>(spec.kind), msg_bytes, spec.nranks) : msg_bytes;
  auto [lanes, lane_bytes] = LanePlan(unit, g, workers, ctx_.cfg.lane_min_bytes);
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
  if (c.announce) {  // a group spanning hosts (device/task.h, "announce"): each rank sends its whole input
    t.in_bytes = static_cast<uint64_t>(spec.in_bytes());  // (the op table's size rule)
    DFCCL_CHECK_CODE(t.in_bytes <= c.announce_bytes, ErrorCode::kInvalidArgument,
                     "dfccl: collective '" << spec.key << "': its group spans hosts, where a rank's input is at most "
                     << c.announce_bytes << " bytes for now (this one: " << t.in_bytes << ")");
    t.match = kMatchAnnounce;
    t.slot = -1;
  }
  return t;
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
void MakeStage(Site& s, Communicator& c, Device& d, Ipc& ipc, int64_t in_bytes, int64_t out_bytes) {
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

const Site* DaemonPath::Prepare(int ordinal, const CollectiveSpec& spec, const std::string& sig, bool staged,
                                int64_t in_bytes, int64_t out_bytes) {
  // A group spanning processes whose memory exchange is still under way (Python
  // imports the peers' handles on a thread, jax_dfccl/_src/distributed.py): wait
  // for it, without the lock (the import takes it), at most timeout_s.
  for (auto t0 = Clock::now();;) {
    {
      auto lk = ctx_.HandlerLock();
      auto it = ctx_.comms.find(spec.group_devices);
      if (it == ctx_.comms.end() || it->second->ready) break;
    }
    if (Clock::now() - t0 > std::chrono::duration<double>(ctx_.timeout_s.load())) break;  // GetComm names it
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  auto lk = ctx_.HandlerLock();
  RelaxedCapture relaxed;
  DFCCL_CHECK_CODE(ctx_.cfg.configured, ErrorCode::kFailedPrecondition,
                   "dfccl: the GPU runtime was not configured (jax_dfccl._src.backend.load() passes every entry "
                   "of jax_dfccl.config to it)");
  DFCCL_CHECK(spec.self_device == ctx_.GlobalOf(ordinal),
              "dfccl: device id " << spec.self_device << " is not local GPU " << ordinal);
  Device& d = ctx_.GetDevice(ordinal);
  if (!d.error.ok()) ctx_.ThrowDeviceError(d);
  PerDevice& q = Of(d);
  Communicator& c = ctx_.GetComm(spec.group_devices);
  auto kc = q.key_ctr.find({&c, spec.key_hash});
  if (kc == q.key_ctr.end()) {
    DFCCL_CHECK_CODE(q.key_ctr.size() < static_cast<size_t>(kMaxKeys), ErrorCode::kResourceExhausted,
                     "dfccl: more than " << kMaxKeys << " collective keys on GPU " << ordinal);
    kc = q.key_ctr.emplace(std::make_pair(&c, spec.key_hash), static_cast<int>(q.key_ctr.size())).first;
  }
  const int64_t msg_bytes = spec.elems_per_block * spec.elem_bytes;
  auto site = std::make_unique<Site>();
  site->index = static_cast<int>(q.sites.size());
  site->d = &d;
  site->c = &c;
  site->key = spec.key;
  site->signature = sig;
  site->key_hash = spec.key_hash;
  site->rank = spec.rank;
  site->msg_bytes = msg_bytes;
  site->large = msg_bytes >= ctx_.cfg.large_threshold;
  TaskDesc t = SiteDesc(spec, c, msg_bytes, kc->second);
  // One lane only: a block that runs several lanes in turn is slower than the
  // daemon's blocks in parallel (measured: 64 KiB, 8 lanes, 4x slower on an H200).
  site->announce = t.match == kMatchAnnounce;
  site->ll = t.pool == 0 && t.lanes == 1 && !site->announce;
  site->tagged = c.cross_process && t.direct && !staged;  // a staged site's slots are tagged once (MakeStage)
  site->identity = t.match == kMatchIdentity;
  // Who sends to this rank: the peer it receives from for ppermute and broadcast
  // (recv_from, also the root), every other rank for the rest (the lanes' RecvsFrom).
  const bool one_source = spec.kind == OpKind::kPermute || spec.kind == OpKind::kBroadcast;
  for (int r = 0; r < spec.nranks; ++r)
    if (r != spec.rank && (!one_source || r == spec.recv_from)) site->senders |= 1u << r;
  if (site->ll) site->inline_kernel = InlineSubmitKernelFor(t.kind, t.dtype, t.reduce);
  t.site = site->index;
  t.sig_hash = HashString(sig) | 1;  // odd: even identity headers name failures (kSigFailed, kSigLeftBehind)
  site->desc = t;
  if (staged) {
    MakeStage(*site, c, d, ctx_.ipc, in_bytes, out_bytes);
    // The running daemon is older than the staging: replaced before any task of
    // this site is published (memcheck would report its reads).  Once per staged site.
    proxy_.Replace(d);
  }
  if (c.cross_process) site->runs = RunsOf(ordinal, spec.group_devices, spec.key_hash);  // protocol "run"
  if (ctx_.key_names.find(spec.key_hash) == ctx_.key_names.end()) ctx_.key_names.emplace(spec.key_hash, spec.key);
  q.sites.push_back(std::move(site));
  proxy_.EnsureRunning(d);
  return q.sites.back().get();
}

// A kernel launch, its host time counted (stats()["cuda"]["host_streamop_us"]).
template <class F>
void DaemonPath::Timed(Device& d, const char* what, F&& launch) {
  const auto t0 = Clock::now();
  const cudaError_t err = launch();
  DFCCL_CHECK_CODE(err == cudaSuccess, ErrorCode::kInternal,
                   "dfccl: " << what << " kernel on GPU " << d.ordinal << ": " << cudaGetErrorString(err));
  ctx_.times.streamop_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

// A submit kernel's parameters of `site` under `f`, before the call's own (buffers, ticket, run).
SubmitParams DaemonPath::SiteParams(const Site& site, const KernelFlags& f) {
  SubmitParams p{};
  p.task = site.desc;
  p.dev = site.d->dev;
  p.host = site.d->host_dev;
  p.site = site.index;
  p.trap = f.trap;
  p.trace = f.trace;
  p.timeout_ns = f.timeout_ns;
  return p;
}

// The hot path: one kernel launch; the lock only when the daemon must be (re)launched.
void DaemonPath::Submit(cudaStream_t stream, const Site& site, const void* in, void* out, int64_t* ticket_out,
                        bool blocking, uint32_t run, const void* init) {
  Device& d = *site.d;
  ctx_.ThrowIfFailed(d);
  const KernelFlags f = ctx_.FlagsFor(stream);
  // The line of the program's book (protocol "run"); inside a command buffer the
  // launch id is the recording's: the kernel reads its execution's from run_word.
  int book = -1;
  if (site.runs && run != 0) {
    std::lock_guard lk(site.runs->mu);
    book = site.runs->book.SlotOf(run);
  }
  if (f.trap) run = 0;
  SubmitParams p = SiteParams(site, f);
  p.book = book + 1;
  p.in = static_cast<const char*>(in);
  p.out = static_cast<char*>(out);
  p.ticket_out = ticket_out;
  p.wait = blocking ? 1 : 0;
  if (site.tagged) {  // the direct path across processes: the ranges that hold in and out (runtime/ipc.h)
    try {
      p.tags = DirectTags(ctx_.ipc.Tag(in, d.ordinal), ctx_.ipc.Tag(out, d.ordinal));
    } catch (const Error& e) {
      throw Error("dfccl: collective '" + site.key + "' (rank " + std::to_string(site.rank) + "): its buffers cannot "
                  "be shared with the other processes of its group (" + e.what() + "); an operand XLA did not "
                  "allocate, such as a constant, cannot be either: compute it inside the program, or set "
                  "jax_dfccl.config.tuning.direct = False (the staged path) before the group's first program is lowered", e.code());
    }
  }
  p.run = run;
  if (blocking && site.ll) {  // the submit kernel may run it itself (device/task.h, "inline")
    p.inline_ns = ctx_.inline_ns.load(std::memory_order_relaxed);
    p.inline_kernel = site.inline_kernel;
    p.spin_ns = ctx_.spin_ns.load(std::memory_order_relaxed);
    p.sticky_max = ctx_.sticky_max.load(std::memory_order_relaxed);
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
  Timed(d, "submit", [&] { return LaunchSubmit(p, stream, ctx_.pdl.load(std::memory_order_relaxed)); });
  // The proxy relaunches a daemon that quit once it sees the record; a call
  // outside a command buffer does it at once (and grows the grid for a large one).
  if (!p.trap && (!proxy_.Running(d) || (site.large && d.workers < ctx_.LargeWorkers(d)))) {
    auto lk = ctx_.HandlerLock();
    RelaxedCapture relaxed;
    if (site.large) d.pending_large++;  // released by the proxy when it sees the record
    if (site.large && proxy_.Running(d) && d.workers < ctx_.LargeWorkers(d)) {
      d.host->resize = d.launch_id;  // the running daemon quits; a larger one is queued behind it
      proxy_.Launch(d);
    }
    proxy_.EnsureRunning(d);
    if (site.large) d.pending_large--;
  }
}

KeyRuns* DaemonPath::RunsOf(int ordinal, const std::vector<int64_t>& group, uint64_t key_hash) {
  std::lock_guard lk(runs_mu_);
  std::unique_ptr<KeyRuns>& kr = runs_[std::make_tuple(ordinal, group, key_hash)];
  if (!kr) kr = std::make_unique<KeyRuns>();
  return kr.get();
}

KeyRuns* DaemonPath::BookOf(int ordinal, const std::vector<int64_t>& group, uint64_t key_hash) {
  bool spans = false;  // (the device ids are set before any collective: read without the lock)
  for (int64_t g : group) spans = spans || ctx_.OrdinalOf(g) < 0;
  return spans && ordinal >= 0 ? RunsOf(ordinal, group, key_hash) : nullptr;
}

// Protocol "run", from XLA's initialize stage: the program's line of the key on this
// GPU opened (at its first execution) and its call sites written; both before any
// of the execution's thunks runs, so before any start reads the line.
void DaemonPath::Plan(int ordinal, KeyRuns& kr, uint32_t run, int64_t site) {
  RunBook::Change ch;
  {
    std::lock_guard lk(kr.mu);
    if (kr.book.SlotOf(run) >= 0) {  // (every execution after a program's first: no slot taken or given)
      ch = kr.book.Plan(run, site, nullptr);
    } else {
      std::lock_guard lk2(runs_mu_);
      RunSlots& slots = slots_.try_emplace(ordinal, kRunSlots).first->second;
      ch = kr.book.Plan(run, site, &slots);
      slots.Give(ch.freed);
    }
  }
  if (ch.slot < 0 || !(ch.open || ch.sites)) return;
  const size_t at = offsetof(DeviceShared, run_slot) + sizeof(RunSlot) * static_cast<size_t>(ch.slot);
  if (ch.open) {
    const int64_t zero = 0;
    WriteBook(ordinal, at, &ch.init, sizeof(RunSlot));
    WriteBook(ordinal, offsetof(DeviceShared, run_owed) + sizeof(int64_t) * static_cast<size_t>(ch.slot), &zero,
              sizeof(zero));
  } else {
    WriteBook(ordinal, at + offsetof(RunSlot, line) + offsetof(RunLine, sites), &ch.init.line.sites, sizeof(int64_t));
  }
}

void DaemonPath::BeginExecution(int ordinal, cudaStream_t stream, uint32_t run) {
  DFCCL_CHECK(ordinal >= 0 && ordinal < kMaxOrdinals, "dfccl: GPU ordinal " << ordinal << " out of range");
  // (XLA's thread of one device calls it; the execution's other starts find it written)
  if (begun_[ordinal].exchange(run, std::memory_order_relaxed) == run) return;
  DeviceShared* dev = dev_[ordinal].load(std::memory_order_acquire);
  if (dev == nullptr) {
    auto lk = ctx_.HandlerLock();
    dev = ctx_.GetDevice(ordinal).dev;
    dev_[ordinal].store(dev, std::memory_order_release);
  }
  DeviceGuard guard(ordinal);
  const cudaError_t e = LaunchRunWord(dev, run, stream);
  DFCCL_CHECK_CODE(e == cudaSuccess, ErrorCode::kInternal,
                   "dfccl: the execution's launch id on GPU " << ordinal << ": " << cudaGetErrorString(e));
}

void DaemonPath::WriteBook(int ordinal, size_t offset, const void* src, size_t bytes) {
  Device* d;
  {
    auto lk = ctx_.HandlerLock();
    d = &ctx_.GetDevice(ordinal);
  }
  DeviceGuard guard(ordinal);
  cudaError_t e = cudaMemcpyAsync(reinterpret_cast<char*>(d->dev) + offset, src, bytes, cudaMemcpyHostToDevice, d->aux);
  if (e == cudaSuccess) e = cudaStreamSynchronize(d->aux);
  DFCCL_CHECK_CODE(e == cudaSuccess, ErrorCode::kInternal,
                   "dfccl: the execution book on GPU " << ordinal << ": " << cudaGetErrorString(e));
}

void DaemonPath::Finish(int ordinal, cudaStream_t stream, const int64_t* ticket, const Site& staged, void* result) {
  Device& d = ctx_.GetDeviceFast(ordinal);
  ctx_.ThrowIfFailed(d);
  const KernelFlags f = ctx_.FlagsFor(stream);
  DoneParams p{};
  p.dev = d.dev;
  p.ticket = ticket;
  p.trap = f.trap;
  p.trace = f.trace;
  p.timeout_ns = f.timeout_ns;
  p.stage = staged.stage;  // the done kernel fills the result from the call's slot
  p.result = static_cast<char*>(result);
  p.out_bytes = staged.out_bytes;
  Timed(d, "done", [&] { return LaunchDone(p, stream, ctx_.pdl.load(std::memory_order_relaxed)); });
}

// The submit kernels' records (HostShared::sub), in ticket order.
void DaemonPath::PollRecords(Device& d, Clock::time_point now) {
  PerDevice& q = Of(d);
  while (true) {
    const uint32_t e = q.seen % kTaskRing;
    volatile SubRec& r = d.host->sub[e];
    const uint32_t gen = r.gen;
    if (static_cast<int32_t>(gen - Gen(q.seen)) < 0) break;
    std::atomic_thread_fence(std::memory_order_acquire);
    TaskInfo& ti = q.info[e];
    ti = TaskInfo{};
    ti.ticket = q.seen;
    ti.t = now;
    ti.done = false;
    if (gen == Gen(q.seen)) {  // (a newer generation: the record was overwritten before it was read)
      const int32_t site = r.site & ~kTombSite;
      ti.tomb = (r.site & kTombSite) != 0;
      if (ti.tomb) tombstones_++;
      ti.seq = r.seq;
      if (site >= 0 && site < static_cast<int32_t>(q.sites.size())) {
        const Site* st = q.sites[site].get();
        ti.site = st;
        ti.comm = st->c;
        ti.key_hash = st->key_hash;
        ti.msg_bytes = st->msg_bytes;
        ti.large = st->large;
      }
    }
    d.pending_large += ti.large ? 1 : 0;
    q.seen++;
  }
}

// The instance's entry in the communicator's match table (a copy), if it has one.
bool DaemonPath::ReadEntry(Communicator& c, uint64_t key_hash, uint64_t seq, MatchEntry* out) {
  const uint64_t id = MatchId(key_hash, seq);
  const int b = MatchBucket(id);
  if (c.table == nullptr) return false;  // (a group spanning hosts over NVSHMEM: no table here)
  std::vector<MatchEntry> ways(kMatchWays);
  try {
    CopyOut(*ctx_.devices[c.io_ordinal], ways.data(), &c.table->entry[b][0], sizeof(MatchEntry) * kMatchWays);
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
uint32_t DaemonPath::IdentityArrived(Device& d, const TaskInfo& ti, uint64_t t) {
  const Communicator& c = *ti.comm;
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
void DaemonPath::OnDaemonTaskDone(Device& d, const TaskInfo& ti, uint32_t status) {
  // kStatusAborted: the host's own message; a tombstone's status is no error (protocol "run").
  if (status == kStatusOk || status == kStatusAborted || !ti.site || ti.tomb) return;
  Communicator& c = *ti.comm;
  if (c.Failed(ti.key_hash, ti.seq)) return;  // reported once
  const uint32_t code = status & 0xff;
  const int a = (status >> 8) & 0xff, b = (status >> 16) & 0xff;
  const std::string name = c.InstanceName(ti.site->key, ti.seq);
  auto sig_of = [&](int rank) -> std::string {
    if (rank >= 0 && rank < c.n && c.ordinals[rank] < 0) return "another signature (in another process)";
    if (rank < 0 || rank >= c.n || !ctx_.devices.count(c.ordinals[rank])) return "?";
    for (const auto& s : Of(*ctx_.devices[c.ordinals[rank]]).sites)
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
      if (ti.site->announce)
        msg << name << ": refused on rank " << a << ", which has its cap of instances of the group in flight";
      else
        msg << name << ": no free entry in the match table";
      break;
    case kStatusAborted:  // a group spanning hosts: the announcements' deadline (the home's verdict or its own)
      ec = ErrorCode::kDeadlineExceeded;
      msg << name << ": timed out after " << ctx_.cfg.timeout_s << " s waiting for rank(s) [";
      for (int r = 0, k = 0; r < c.n; ++r)
        if (status >> (24 + r) & 1) msg << (k++ ? ", " : "") << r << " (device " << c.globals[r] << ")";
      msg << "] (never started it, or their messages did not arrive)";
      break;
    case kStatusLeftBehind:  // device/task.h, "run"
      if (a == ti.site->rank && b != a && ti.site->runs) {  // this start was ahead: its execution pairs further on
        std::pair<int, int64_t> owed;
        {
          std::lock_guard lk(ti.site->runs->mu);
          owed = ti.site->runs->book.Owe(1);
        }
        if (owed.first >= 0) {
          DeviceGuard guard(d.ordinal);
          cudaError_t e = cudaMemcpyAsync(&d.dev->run_owed[owed.first], &owed.second, sizeof(int64_t),
                                          cudaMemcpyHostToDevice, d.aux);
          if (e == cudaSuccess) e = cudaStreamSynchronize(d.aux);
          DFCCL_CHECK_CODE(e == cudaSuccess, ErrorCode::kInternal,
                           "dfccl: the execution book on GPU " << d.ordinal << ": " << cudaGetErrorString(e));
        }
      }
      msg << name << ": a peer's program failed: rank " << a << (a != b ? " (from another execution than rank " +
                                                                           std::to_string(b) + ")" : "")
          << " ran its program again after that program failed before it started this collective, so this "
          << "execution's instance belongs with the failed one (the next execution pairs again)";
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
  c.Fail(ti.key_hash, ti.seq, ec, msg.str());
}

void DaemonPath::AbortTask(Device& d, uint64_t t) {
  d.host->abort[t % kTaskRing] = Gen(t);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  d.host->abort_gen = d.host->abort_gen + 1;
  proxy_.EnsureRunning(d);
}

// Watchdog: fails a daemon-path instance on every local rank (the control warps
// also mark its match entry failed, so ranks of other processes abort it too).
void DaemonPath::AbortDaemonInstance(Communicator& c, uint64_t key_hash, uint64_t seq, ErrorCode code, const std::string& msg) {
  c.Fail(key_hash, seq, code, msg);
  for (int ord : c.ordinals) {
    auto it = ctx_.devices.find(ord);
    if (it == ctx_.devices.end()) continue;
    Device& d = *it->second;
    PerDevice& q = Of(d);
    bool any = false;
    for (uint64_t t = q.oldest; t < q.seen; ++t) {
      const TaskInfo& ti = q.info[t % kTaskRing];
      if (ti.done || ti.comm != &c || ti.key_hash != key_hash || ti.seq != seq) continue;
      d.host->abort[t % kTaskRing] = Gen(t);
      any = true;
    }
    if (!any) continue;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    d.host->abort_gen = d.host->abort_gen + 1;
    proxy_.EnsureRunning(d);
  }
}

}  // namespace dfccl::gpu
