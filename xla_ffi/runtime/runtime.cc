// The facade (runtime.h): the module's configure/config/stats/trace/reset,
// raise_if_failed, the exchange across processes; Pending() is in inspect.cc.
// Every function here takes Context::mu itself.
#include "runtime/runtime.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <set>
#include <tuple>

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
      g.proxy_.Stop();
      g.ctx_.ce.Stop();
    });
    return r;
  }();
  return *rt;
}

Runtime::Runtime() { ctx_.proxy = &proxy_; }

Runtime::~Runtime() = default;

void Runtime::SetDeviceIds(const std::vector<std::pair<int64_t, int>>& ids) {
  std::lock_guard lk(ctx_.mu);
  DFCCL_CHECK(ctx_.comms.empty(), "dfccl: device ids must be set before the first collective");
  for (auto [g, o] : ids) { ctx_.ordinal_of[g] = o; ctx_.global_of[o] = g; }
}

void Runtime::SetLostDevices(const std::vector<int64_t>& ids, const std::string& why) {
  std::lock_guard lk(ctx_.lost_mu);
  for (int64_t g : ids) ctx_.lost.emplace(g, why);
  ctx_.nlost.store(static_cast<int>(ctx_.lost.size()));
}

void Runtime::SetDaemonEngine(uintptr_t engine) {
  std::lock_guard lk(ctx_.mu);
  const auto* e = reinterpret_cast<const DaemonEngine*>(engine);
  DFCCL_CHECK(e != nullptr && e->name != nullptr && e->launch != nullptr, "dfccl: no daemon engine at that address");
  if (e == ctx_.engine) return;
  DFCCL_CHECK_CODE(ctx_.devices.empty(), ErrorCode::kFailedPrecondition,
                   "dfccl: the daemon over " << e->name << " must be set up before the first collective on a GPU "
                   "(call jax_dfccl.initialize() first)");
  ctx_.engine = e;
}

std::string Runtime::DaemonEngineName() {
  std::lock_guard lk(ctx_.mu);
  return ctx_.engine->name;
}

void Runtime::StartIpc(const std::string& name) {
  std::lock_guard lk(ctx_.mu);
  std::vector<int> ordinals;
  for (auto& [g, o] : ctx_.ordinal_of) ordinals.push_back(o);
  DFCCL_CHECK(!ordinals.empty(), "dfccl: set_device_ids before start_ipc");
  DFCCL_CHECK(name.size() < Communicator::kNameBytes, "dfccl: socket name too long: " << name);
  ctx_.ipc.Start(name, ordinals);
}

std::string Runtime::CanExport(int ordinal, const void* p) {
  DeviceGuard guard(ordinal);
  return Ipc::CanExport(p);
}

std::string Runtime::ExportComm(const std::vector<int64_t>& group, int rank, bool spans_hosts,
                                const std::vector<int32_t>& hosts, uint64_t latency_ns) {
  std::lock_guard lk(ctx_.mu);
  auto it = ctx_.comms.find(group);
  if (it == ctx_.comms.end()) {
    DFCCL_CHECK(hosts.empty() || hosts.size() == group.size(), "dfccl: one host per rank of [" << GroupText(group) << "]");
    it = ctx_.comms.emplace(group, std::make_unique<Communicator>(ctx_, group, true, spans_hosts)).first;
    it->second->hosts = hosts;
    it->second->latency_ns = latency_ns;
  }
  DFCCL_CHECK(it->second->announce == spans_hosts, "dfccl: the group of devices [" << GroupText(group)
              << "] was set up " << (spans_hosts ? "within one host" : "as spanning hosts") << " already");
  return it->second->Export(rank);
}

void Runtime::ImportComm(const std::vector<int64_t>& group, const std::vector<std::string>& blobs) {
  std::lock_guard lk(ctx_.mu);
  auto it = ctx_.comms.find(group);
  DFCCL_CHECK(it != ctx_.comms.end(), "dfccl: import of a group this process did not export");
  it->second->Import(blobs);
}

bool Runtime::UsesCopyEngine(OpKind kind, int nranks, int64_t in_bytes, int64_t out_bytes) {
  std::lock_guard lk(ctx_.mu);
  if (!ctx_.ordinal_of.empty()) return false;  // across processes: the daemon path (the mover needs peer access)
  return ce_path_.UseCopyEngine(kind, nranks, std::max(in_bytes, out_bytes));
}

Config Runtime::config() {
  std::lock_guard lk(ctx_.mu);
  return ctx_.cfg;
}

void Runtime::Configure(const std::map<std::string, double>& kv) {
  std::lock_guard lk(ctx_.mu);
  ctx_.cfg.Apply(kv);
  ctx_.timeout_s = ctx_.cfg.timeout_s;
  ctx_.trace = ctx_.cfg.trace;
  if (ctx_.cfg.configured) {
    ctx_.large_workers = ctx_.cfg.large_workers();
    ctx_.inline_ns = ctx_.cfg.inline_ns();
    ctx_.spin_ns = ctx_.cfg.spin_ns();
    ctx_.sticky_max = ctx_.cfg.sticky_max();
    ctx_.pdl = ctx_.cfg.submit_pdl;
  }
  ctx_.ce.Configure(CeSettings{ctx_.cfg.copy_engine_chunk_bytes, ctx_.cfg.copy_engine_blocks, ctx_.cfg.copy_engine_push});
  if (kv.count("timeout_s"))  // groups spanning hosts keep their deadline on the device (protocol "announce")
    for (auto& [group, c] : ctx_.comms)
      if (c->announce && c->ready) c->SetAnnounceConfig();
}

std::map<std::string, double> Runtime::Stats(std::vector<std::string>* errors) {
  std::lock_guard lk(ctx_.mu);
  std::map<std::string, double> s;
  double started = 0, completed = 0, failed = 0, preempts = 0, resumes = 0, steps = 0, aborted = 0, launches = 0;
  double relaunches = 0, daemon_done = 0, trace_records = 0, inline_done = 0, identity_done = 0;
  double dev_bytes = 0, host_bytes = 0, running = 0, live = 0, slots_used = 0, waiting = 0;
  std::set<std::tuple<Communicator*, uint64_t, uint64_t>> pending_instances;
  // After a kernel trapped (a failure inside a command buffer) the CUDA context is
  // gone: the device's counters count as 0 and the reason joins the errors.
  std::vector<std::string> unreadable;
  // The fused ops' instances: counted per device (Device::fused_started,
  // completed, failed) once their done words were looked at, in flight on
  // their channels, traced on the host.
  overlap_.Poll(Clock::now());
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
  for (auto& [ord, d] : ctx_.devices) {
    daemon_.PollRecords(*d, Clock::now());  // every record written before a done the caller saw
    const DaemonPath::PerDevice& q = daemon_.Of(*d);
    started += q.seen + ce_path_.Of(*d).ce_next + d->fused_started;
    std::vector<TaskRun> runs(kTaskRing);
    if (q.oldest < q.seen) read(*d, runs.data(), d->dev->run, sizeof(TaskRun) * kTaskRing);
    for (uint64_t t = q.oldest; t < q.seen; ++t) {
      const TaskInfo& ti = q.info[t % kTaskRing];
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
    running += proxy_.Alive(*d) ? 1 : 0;
  }
  live += static_cast<double>(pending_instances.size());
  live += static_cast<double>(overlap_.Live());
  trace_records += static_cast<double>(ctx_.host_trace.size());
  for (auto& [name, c] : ctx_.comms) {
    dev_bytes += c->bytes;
    live += c->live.size();
    unsigned long long bits[kNumPools][kMaxPoolSlots / 64];
    // (a group spanning hosts over NVSHMEM maps no peer memory: its table is rank 0's, elsewhere)
    if (!c->ready || c->table == nullptr) continue;
    if (!read(*ctx_.devices[c->io_ordinal], bits, c->table->free_bits, sizeof(bits))) continue;
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
  s["communicators"] = static_cast<double>(ctx_.comms.size());
  s["instances_live"] = live;
  s["trace_records"] = trace_records;
  s["daemon_tasks_done"] = daemon_done;
  s["inline_done"] = inline_done;
  s["identity_done"] = identity_done;
  s["tombstones"] = static_cast<double>(daemon_.tombstones());
  s["steps"] = steps;
  s["aborted"] = aborted;
  s["launches"] = launches;
  s["relaunches"] = relaunches;
  s["bytes_held"] = dev_bytes;
  s["host_bytes_held"] = host_bytes;
  double sms = 0;
  for (auto& [ord, d] : ctx_.devices) sms = std::max<double>(sms, d->launched ? d->workers + 1 : 0);
  s["sms_used"] = sms;                      // blocks of the latest daemon (max over devices)
  s["sms_default"] = ctx_.cfg.workers() + 1;
  s["sms_large"] = ctx_.cfg.large_workers() + 1;
  s["daemons_running"] = running;
  s["devices"] = static_cast<double>(ctx_.devices.size());
  s["slots_in_use"] = slots_used;
  s["instances_waiting_for_slot"] = waiting;
  s["copy_engine_ops"] = static_cast<double>(ctx_.ce.issued());  // instances moved by the copy engines
  s["copy_engine_issue_us"] = ctx_.ce.issue_s() * 1e6;          // host time enqueueing them (all ranks), total
  s["copy_engine_gpu_us"] = ctx_.ce.gpu_s() * 1e6;              // rank 0's GPU time, first copy .. done, total
  s["copy_engine_timed"] = static_cast<double>(ctx_.ce.timed()); // ... over this many of them
  const auto per = [](int64_t ns, int64_t n) { return n > 0 ? static_cast<double>(ns) / n / 1e3 : 0.0; };
  s["host_start_us"] = per(ctx_.times.start_ns, ctx_.times.starts);
  s["host_done_us"] = per(ctx_.times.done_ns, ctx_.times.dones);
  s["host_streamop_us"] = per(ctx_.times.streamop_ns, ctx_.times.starts + ctx_.times.dones);
  s["host_gap_us"] = per(ctx_.times.gap_ns, ctx_.times.gaps);
  s["host_calls"] = static_cast<double>(ctx_.times.starts + ctx_.times.dones);
  s["ranges_exported"] = static_cast<double>(ctx_.ipc.exported());  // allocations shared with other processes
  s["ranges_mapped"] = static_cast<double>(ctx_.ipc.mapped());      // other processes' allocations mapped here
  s["overlap_channels"] = static_cast<double>(overlap_.channels());  // fused ops' (communicator, key) channels
  if (errors) {
    *errors = ctx_.errors;
    for (auto& e : ctx_.ipc.errors()) errors->push_back(e);
    std::sort(unreadable.begin(), unreadable.end());
    unreadable.erase(std::unique(unreadable.begin(), unreadable.end()), unreadable.end());
    errors->insert(errors->end(), unreadable.begin(), unreadable.end());
  }
  return s;
}

std::vector<TraceOut> Runtime::Trace() {
  const auto& kNames = kTraceEventNames;
  std::lock_guard lk(ctx_.mu);
  std::vector<TraceOut> out;
  for (auto& [ord, d] : ctx_.devices) {
    std::vector<BlockStats> rows(kMaxBlocks);
    CopyOut(*d, rows.data(), d->dev->stats, sizeof(BlockStats) * kMaxBlocks);
    std::vector<TraceRec> ring(static_cast<size_t>(kMaxBlocks) * kTracePerBlock);
    CopyOut(*d, ring.data(), d->dev->trace, ring.size() * sizeof(TraceRec));
    for (int b = 0; b < kMaxBlocks; ++b) {
      const uint64_t head = rows[b].trace_head;
      const uint64_t first = head > kTracePerBlock ? head - kTracePerBlock : 0;
      for (uint64_t i = first; i < head; ++i) {
        const TraceRec& r = ring[static_cast<size_t>(b) * kTracePerBlock + i % kTracePerBlock];
        auto k = ctx_.key_names.find(r.key_hash);
        out.push_back(TraceOut{ord, k != ctx_.key_names.end() ? k->second : std::to_string(r.key_hash), r.seq,
                               r.event < kNumTraceEvents ? kNames[r.event] : "?", r.t_ns});
      }
    }
    std::vector<TraceRec> waits(static_cast<size_t>(kTaskRing) * kNumStreamEvents);
    CopyOut(*d, waits.data(), d->dev->stream_trace, waits.size() * sizeof(TraceRec));
    for (const TraceRec& r : waits) {
      if (r.t_ns == 0) continue;
      auto k = ctx_.key_names.find(r.key_hash);
      out.push_back(TraceOut{ord, k != ctx_.key_names.end() ? k->second : std::to_string(r.key_hash), r.seq,
                             r.event < kNumTraceEvents ? kNames[r.event] : "?", r.t_ns});
    }
  }
  overlap_.Poll(Clock::now());
  for (const HostTraceRec& r : ctx_.host_trace) {  // the fused ops' (host clock)
    auto k = ctx_.key_names.find(r.key_hash);
    out.push_back(TraceOut{r.device, k != ctx_.key_names.end() ? k->second : std::to_string(r.key_hash), r.seq,
                           r.event, r.t_ns});
  }
  std::stable_sort(out.begin(), out.end(), [](const TraceOut& a, const TraceOut& b) { return a.t_ns < b.t_ns; });
  return out;
}

// Tests call it after an injected fault, with nothing in flight: every
// sequence number restarts at 0 (on the host for the copy-engine path, on the
// devices for the daemon path) and the match tables start empty.
void Runtime::Reset() {
  std::lock_guard lk(ctx_.mu);
  ctx_.errors.clear();
  ctx_.host_trace.clear();
  for (auto& [ord, d] : ctx_.devices) {
    d->error = Status{};
    d->error_once = false;
    d->has_error.store(false);
    ce_path_.Of(*d).fifo.clear();
    DeviceGuard guard(d->ordinal);
    cudaError_t e = cudaMemsetAsync(d->dev->seq_ctr, 0, sizeof(d->dev->seq_ctr), d->aux);
    if (e == cudaSuccess) e = cudaStreamSynchronize(d->aux);
    DFCCL_CHECK_CODE(e == cudaSuccess, ErrorCode::kInternal, "dfccl: reset on GPU " << d->ordinal << ": " << cudaGetErrorString(e));
  }
  for (auto& [name, c] : ctx_.comms) {
    c->ClearSeqs();
    c->ClearFailures();
    if (c->ready && c->ordinals[0] >= 0 && c->table) c->InitTable();  // the table's owner (rank 0's process) resets it
    if (c->announce && c->ready) {  // (every process's reset() advances it alike)
      c->ann_generation++;
      c->SetAnnounceConfig();
    }
  }
}

void Runtime::RaiseIfFailed() {
  auto lk = ctx_.HandlerLock();
  const auto now = Clock::now();
  for (auto& [ord, d] : ctx_.devices) proxy_.PollDevice(*d, now);
  overlap_.Poll(now);
  for (auto& [ord, d] : ctx_.devices)
    if (!d->error.ok()) ctx_.ThrowDeviceError(*d);
}

}  // namespace dfccl::gpu
