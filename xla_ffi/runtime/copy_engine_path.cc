// The copy-engine path's host side (the *_host targets): host matching, the
// copy-engine ring's tickets, the ready write and done wait on XLA's stream.
#include <algorithm>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "runtime/driver.h"
#include "runtime/runtime.h"

namespace dfccl::gpu {
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

// Under mu_: the copy-engine path's start: matches the instance on the host and
// takes a ticket of the copy-engine ring (kCeTicket set).
uint64_t Runtime::SubmitCe(Device& d, const CollectiveSpec& spec, const std::string& sig, const void* in, void* out) {
  DFCCL_CHECK(spec.self_device == GlobalOf(d.ordinal),
              "dfccl: device id " << spec.self_device << " is not local GPU " << d.ordinal
                                  << " (the CUDA backend runs in one process)");
  Comm& c = GetComm(spec.group_devices);
  const int64_t bytes = std::max(spec.in_bytes(), spec.out_elems * spec.elem_bytes);
  DFCCL_CHECK(UseCopyEngine(spec.kind, c.n, bytes),
              "dfccl: collective '" << spec.key << "' was compiled for the copy-engine path, which "
                                    << "copy_engine_min_bytes no longer gives it (a trace-time entry: re-trace)");
  const uint64_t seq = d.seq[{&c, spec.key_hash}]++;
  const int64_t msg_bytes = spec.elems_per_block * spec.elem_bytes;
  Instance* inst = Join(c, spec, sig, seq);
  if (key_names_.find(spec.key_hash) == key_names_.end()) key_names_.emplace(spec.key_hash, spec.key);
  const uint64_t ticket = d.ce_next;
  TaskInfo& ti = d.ce_info[ticket % kCeRing];
  DFCCL_CHECK_CODE(ti.done, ErrorCode::kResourceExhausted,
                   "dfccl: more than " << kCeRing << " copy-engine collectives in flight on GPU " << d.ordinal);
  inst->tasks.emplace_back(&d, ticket | kCeTicket);
  inst->started |= 1u << spec.rank;
  ti = TaskInfo{inst, nullptr, &c, ticket, Clock::now(), false, false, msg_bytes, spec.key_hash, inst->seq};
  d.ce_next = ticket + 1;
  StartCopyEngine(d, c, *inst, spec, in, out, ticket);
  return ticket | kCeTicket;
}

// Outside mu_ (an enqueue on XLA's stream may block while its queue is full):
// the stream-ordered ready write, the done wait, or both.
void Runtime::EnqueueOnStream(cudaStream_t stream, const Enqueue& e, bool ready, bool wait) {
  const auto t0 = Clock::now();
  Device& d = *e.d;
  void* ready_word = const_cast<uint32_t*>(&d.host_dev->ce_ready[e.ticket % kCeRing]);
  const uint32_t* done_word = const_cast<const uint32_t*>(&d.host_dev->ce_done[e.ticket % kCeRing]);
  const uint32_t gen = Gen(e.ticket, kCeRing);
  if (ready) StreamOps::Write32(stream, ready_word, gen);
  if (wait) {
    // Bounded as the daemon path's done wait is (FlagsFor: 2 * config.timeout_s + 10 s, past the
    // host watchdog's config.timeout_s, which writes the word when it aborts the instance).
    const cudaError_t err = LaunchStreamWait(stream, done_word, gen, FlagsFor(stream).timeout_ns, e.ticket);
    DFCCL_CHECK_CODE(err == cudaSuccess, ::dfccl::ErrorCode::kInternal, "dfccl: done wait kernel on GPU " << d.ordinal << ": " << cudaGetErrorString(err));
  }
  times_.streamop_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

void Runtime::StartHost(int ordinal, cudaStream_t stream, const CollectiveSpec& spec, const std::string& sig,
                        const void* in, void* out, bool blocking) {
  Enqueue e;
  {
    auto lk = HandlerLock();
    DFCCL_CHECK_CODE(cfg_.configured, ErrorCode::kFailedPrecondition,
                     "dfccl: the GPU runtime was not configured (jax_dfccl._src.backend.load() passes every entry "
                     "of jax_dfccl.config to it)");
    Device& d = GetDevice(ordinal);
    if (!d.error.ok()) ThrowDeviceError(d);
    uint64_t ticket = 0;
    try {
      ticket = SubmitCe(d, spec, sig, in, out);
    } catch (const Error& ex) {  // mismatch, a failed instance, a full ring: kept for stats()["errors"]
      RecordError(ex.what());
      throw;
    }
    if (!blocking) d.fifo[spec.site].push_back(ticket);  // DoneHost pairs with it
    e = Enqueue{&d, ticket & ~kCeTicket};
  }
  EnqueueOnStream(stream, e, /*ready=*/true, /*wait=*/blocking);
}

void Runtime::DoneHost(int ordinal, cudaStream_t stream, int64_t site) {
  Enqueue e;
  {
    auto lk = HandlerLock();
    Device& d = GetDevice(ordinal);
    auto& q = d.fifo[site];
    if (!d.error.ok()) {  // this done still consumes its start (the pairing of later ones stays right)
      if (!q.empty()) q.pop_front();
      ThrowDeviceError(d);
    }
    DFCCL_CHECK_CODE(!q.empty(), ErrorCode::kFailedPrecondition,
                     "dfccl: dfccl_done at site " << site << " has no pending start");
    e = Enqueue{&d, q.front() & ~kCeTicket};
    q.pop_front();
  }
  EnqueueOnStream(stream, e, /*ready=*/false, /*wait=*/true);
}

}  // namespace dfccl::gpu
