// The copy-engine path's host side (copy_engine_path.h): host matching, the
// copy-engine ring's tickets, the ready write and done wait on XLA's stream,
// the completion and abort of its instances (called by the proxy).
// Owns CopyEnginePath::PerDevice.  Lock: StartHost and DoneHost take
// Context::mu (HandlerLock) for the matching and the ring, then enqueue on
// XLA's stream without it; OnTaskDone and Abort run under it (the proxy's).
#include "runtime/copy_engine_path.h"

#include <algorithm>
#include <chrono>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "runtime/communicator.h"
#include "runtime/driver.h"

namespace dfccl::gpu {

bool CopyEnginePath::UseCopyEngine(OpKind kind, int nranks, int64_t bytes) const {
  const bool reduction = Reduces(kind);
  return ctx_.cfg.copy_engine_min_bytes >= 0 && bytes >= ctx_.cfg.copy_engine_min_bytes && nranks > 1 &&
         (!reduction || bytes >= ctx_.cfg.copy_engine_reduce_min_bytes) && CopyEngine::Supports(kind, nranks);
}

// Copy-engine path: a ticket of the device's second ring; the instance goes to
// the mover once its last rank has started.
void CopyEnginePath::StartCopyEngine(Device& d, Communicator& c, Instance& inst, const CollectiveSpec& spec,
                                     const void* in, void* out, uint64_t ticket) {
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
  ctx_.ce.Submit(std::move(op));
}

// Under Context::mu: the copy-engine path's start: matches the instance on the host and
// takes a ticket of the copy-engine ring (kCeTicket set).
uint64_t CopyEnginePath::SubmitCe(Device& d, const CollectiveSpec& spec, const std::string& sig, const void* in,
                                  void* out) {
  DFCCL_CHECK(spec.self_device == ctx_.GlobalOf(d.ordinal),
              "dfccl: device id " << spec.self_device << " is not local GPU " << d.ordinal
                                  << " (the CUDA backend runs in one process)");
  Communicator& c = ctx_.GetComm(spec.group_devices);
  const int64_t bytes = std::max(spec.in_bytes(), spec.out_elems * spec.elem_bytes);
  DFCCL_CHECK(UseCopyEngine(spec.kind, c.n, bytes),
              "dfccl: collective '" << spec.key << "' was compiled for the copy-engine path, which "
                                    << "copy_engine_min_bytes no longer gives it (a trace-time entry: re-trace)");
  const uint64_t seq = c.NextSeq(d.ordinal, spec.key_hash);
  const int64_t msg_bytes = spec.elems_per_block * spec.elem_bytes;
  Instance* inst = Join(c, spec, sig, seq);
  if (ctx_.key_names.find(spec.key_hash) == ctx_.key_names.end()) ctx_.key_names.emplace(spec.key_hash, spec.key);
  PerDevice& q = Of(d);
  const uint64_t ticket = q.ce_next;
  TaskInfo& ti = q.ce_info[ticket % kCeRing];
  DFCCL_CHECK_CODE(ti.done, ErrorCode::kResourceExhausted,
                   "dfccl: more than " << kCeRing << " copy-engine collectives in flight on GPU " << d.ordinal);
  inst->tasks.emplace_back(&d, ticket | kCeTicket);
  inst->started |= 1u << spec.rank;
  ti = TaskInfo{inst, nullptr, &c, ticket, Clock::now(), false, false, msg_bytes, spec.key_hash, inst->seq};
  q.ce_next = ticket + 1;
  StartCopyEngine(d, c, *inst, spec, in, out, ticket);
  return ticket | kCeTicket;
}

// Outside Context::mu (an enqueue on XLA's stream may block while its queue is full):
// the stream-ordered ready write, the done wait, or both.
void CopyEnginePath::EnqueueOnStream(cudaStream_t stream, const Enqueue& e, bool ready, bool wait) {
  const auto t0 = Clock::now();
  Device& d = *e.d;
  void* ready_word = const_cast<uint32_t*>(&d.host_dev->ce_ready[e.ticket % kCeRing]);
  const uint32_t* done_word = const_cast<const uint32_t*>(&d.host_dev->ce_done[e.ticket % kCeRing]);
  const uint32_t gen = Gen(e.ticket, kCeRing);
  if (ready) StreamOps::Write32(stream, ready_word, gen);
  if (wait) {
    // Bounded as the daemon path's done wait is (FlagsFor: 2 * config.timeout_s + 10 s, past the
    // host watchdog's config.timeout_s, which writes the word when it aborts the instance).
    const cudaError_t err = LaunchStreamWait(stream, done_word, gen, ctx_.FlagsFor(stream).timeout_ns, e.ticket);
    DFCCL_CHECK_CODE(err == cudaSuccess, ::dfccl::ErrorCode::kInternal, "dfccl: done wait kernel on GPU " << d.ordinal << ": " << cudaGetErrorString(err));
  }
  ctx_.times.streamop_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

void CopyEnginePath::StartHost(int ordinal, cudaStream_t stream, const CollectiveSpec& spec, const std::string& sig,
                               const void* in, void* out, bool blocking) {
  Enqueue e;
  {
    auto lk = ctx_.HandlerLock();
    DFCCL_CHECK_CODE(ctx_.cfg.configured, ErrorCode::kFailedPrecondition,
                     "dfccl: the GPU runtime was not configured (jax_dfccl._src.backend.load() passes every entry "
                     "of jax_dfccl.config to it)");
    Device& d = ctx_.GetDevice(ordinal);
    if (!d.error.ok()) ctx_.ThrowDeviceError(d);
    uint64_t ticket = 0;
    try {
      ticket = SubmitCe(d, spec, sig, in, out);
    } catch (const Error& ex) {  // mismatch, a failed instance, a full ring: kept for stats()["errors"]
      ctx_.RecordError(ex.what());
      throw;
    }
    if (!blocking) Of(d).fifo[spec.site].push_back(ticket);  // DoneHost pairs with it
    e = Enqueue{&d, ticket & ~kCeTicket};
  }
  EnqueueOnStream(stream, e, /*ready=*/true, /*wait=*/blocking);
}

void CopyEnginePath::DoneHost(int ordinal, cudaStream_t stream, int64_t site) {
  Enqueue e;
  {
    auto lk = ctx_.HandlerLock();
    Device& d = ctx_.GetDevice(ordinal);
    auto& q = Of(d).fifo[site];
    if (!d.error.ok()) {  // this done still consumes its start (the pairing of later ones stays right)
      if (!q.empty()) q.pop_front();
      ctx_.ThrowDeviceError(d);
    }
    DFCCL_CHECK_CODE(!q.empty(), ErrorCode::kFailedPrecondition,
                     "dfccl: dfccl_done at site " << site << " has no pending start");
    e = Enqueue{&d, q.front() & ~kCeTicket};
    q.pop_front();
  }
  EnqueueOnStream(stream, e, /*ready=*/false, /*wait=*/true);
}

// The copy-engine path's host matching: the instance of (key, seq), created by
// its first rank; later ranks must agree on its signature.
Instance* CopyEnginePath::Join(Communicator& c, const CollectiveSpec& spec, const std::string& sig, uint64_t seq) {
  const auto id = std::make_pair(spec.key_hash, seq);
  // (An instance that failed while some rank's task was still out stays in `live`
  // until the proxy saw each of its tasks done; then it is a tombstone.)
  if (c.Failed(spec.key_hash, seq) && c.live.find(id) == c.live.end()) {
    throw Error("dfccl: collective '" + spec.key + "' (sequence " + std::to_string(seq) +
                ") already failed on another rank", ErrorCode::kAborted);
  }
  auto it = c.live.find(id);
  if (it == c.live.end()) {
    auto inst = std::make_unique<Instance>();
    inst->key_hash = spec.key_hash;
    inst->seq = seq;
    inst->key = spec.key;
    inst->signature = sig;
    inst->nranks = c.n;
    it = c.live.emplace(id, std::move(inst)).first;
  }
  Instance* inst = it->second.get();
  if (inst->signature != sig) {
    throw Error("dfccl: collective '" + spec.key + "' (sequence " + std::to_string(seq) + "): rank " +
                    std::to_string(spec.rank) + " started it as " + sig + " but another rank as " + inst->signature,
                ErrorCode::kFailedPrecondition);
  }
  if (inst->started & (1u << spec.rank)) {
    throw Error("dfccl: collective '" + spec.key + "' started twice by rank " + std::to_string(spec.rank),
                ErrorCode::kFailedPrecondition);
  }
  return inst;
}

void CopyEnginePath::OnTaskDone(Device& d, TaskInfo& ti) {
  Instance* inst = ti.inst;
  Communicator* c = ti.comm;
  ti.inst = nullptr;
  if (!inst) return;
  inst->done++;
  const bool all = inst->done == inst->nranks || (inst->failed && inst->done == static_cast<int>(inst->tasks.size()));
  if (!all) return;
  const auto id = std::make_pair(inst->key_hash, inst->seq);
  if (inst->failed) {
    // Keep failed instances (a late rank gets the error); no task refers to it any more.
    auto it = c->live.find(id);
    if (it != c->live.end()) { c->tombstones[id] = std::move(it->second); c->live.erase(it); }
  } else {
    c->live.erase(id);
  }
  (void)d;
}

// The copy-engine path's abort (host-matched instances).
void CopyEnginePath::Abort(Communicator& c, Instance& inst, ErrorCode code, const std::string& why) {
  inst.failed = true;
  c.Fail(inst.key_hash, inst.seq, code, c.InstanceName(inst.key, inst.seq) + " " + why);
  // Once issued, their copies complete on their own (all inputs were ready);
  // otherwise the host releases the ranks' done waits.
  const bool all_started = inst.started == (1u << c.n) - 1;
  const bool release_ce = !all_started || ctx_.ce.Cancel(&c, inst.key_hash, inst.seq);
  if (!release_ce) return;
  for (auto& [d, tagged] : inst.tasks) {
    const uint64_t ticket = tagged & ~kCeTicket;
    d->host->ce_done[ticket % kCeRing] = Gen(ticket, kCeRing);  // Fail set the devices' error above
  }
}

}  // namespace dfccl::gpu
