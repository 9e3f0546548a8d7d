// The fused-op path (overlap_path.h): channels per (communicator, key), the
// instances' start and commit, the proxy's poll of their ready and done words,
// their deadline and failure, their lines in pending().
// Lock: Begin, Commit and Device take Context::mu; every other function runs
// under it (the proxy's round, the facade's stats, trace, pending).
#include "runtime/overlap_path.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <sstream>

#include "dfccl/check.h"
#include "runtime/communicator.h"
#include "runtime/driver.h"

#define OV_CUDA(call) DFCCL_CHECK_CUDA(call, "dfccl overlap")

namespace dfccl::gpu {
namespace {

using overlap::Mailbox;

constexpr uint32_t kWaitHostDeadline = 7;  // error word written by the host's deadline (not a kernel WaitWhat)

bool Reached(uint32_t value, uint32_t seq) { return int32_t(value - seq) >= 0; }
uint32_t Load(const uint32_t* p) { return *reinterpret_cast<const volatile uint32_t*>(p); }

const char* OpName(int kind) {
  return kind == overlap::kAllGatherGemm ? "all_gather_matmul" : "matmul_reduce_scatter";
}

// The key's hash: the instance's name in the communicator's failure record and
// in the trace (Context::key_names), apart from the other paths' keys.
uint64_t KeyHash(std::string_view key) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over "overlap:" + key
  for (char ch : std::string("overlap:") + std::string(key)) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  return h;
}

uint64_t HostNs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

std::string StartedMask(const OverlapPath::Channel& c, uint32_t seq) {  // runtime/inspect.cc Mask
  std::string s;
  for (int r = 0; r < c.nranks; ++r) s += Reached(Load(&c.mbox->ready[r]), seq) ? 'S' : '.';
  return s;
}

// What a kernel's recorded error code says (protocol.h ErrorCode).
std::string DescribeCode(const OverlapPath::Channel& c, uint32_t code) {
  static const char* what[] = {"?", "the ready flag (receive buffer free)", "partial tiles", "gathered rows",
                               "the ready flag (gather buffer free)", "its own partial tiles (local)",
                               "its own split tiles' partial accumulators (local)"};
  const uint32_t w = code >> 24, waiter = (code >> 16) & 0xff, peer = (code >> 8) & 0xff;
  const auto& ords = c.comm->ordinals;
  std::ostringstream os;
  os << "rank " << waiter << " (GPU " << ords[waiter % ords.size()] << ") waited for " << what[w <= 6 ? w : 0]
     << " of rank " << peer << " (GPU " << ords[peer % ords.size()] << ")";
  return os.str();
}

}  // namespace

void OverlapPath::ThrowIfFailed(int ordinal) {
  if (ordinal < 0 || ordinal >= static_cast<int>(ctx_.by_ordinal.size())) return;
  if (gpu::Device* d = ctx_.by_ordinal[ordinal].load(std::memory_order_acquire)) ctx_.ThrowIfFailed(*d);
}

OverlapPath::PerDevice& OverlapPath::Device(int ordinal, DeviceInit init) {
  {
    auto lk = ctx_.HandlerLock();
    auto it = devices_.find(ordinal);
    if (it != devices_.end()) return it->second;  // (never erased: the reference stays valid)
  }
  // Set up outside the lock: loading the kernels may wait for the device
  // (lazy module loading), where a kernel of the daemon path may spin until
  // the proxy, which needs the lock, lets it finish.
  DeviceGuard guard(ordinal);
  PerDevice d;
  OV_CUDA(cudaStreamCreateWithFlags(&d.side, cudaStreamNonBlocking));
  OV_CUDA(cudaEventCreateWithFlags(&d.start, cudaEventDisableTiming));
  OV_CUDA(cudaEventCreateWithFlags(&d.done, cudaEventDisableTiming));
  OV_CUDA(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, ordinal));
  init(d);  // before anything of ours runs on the device (overlap/launch.h): every kernel loaded
  auto lk = ctx_.HandlerLock();
  return devices_.emplace(ordinal, d).first->second;  // (one handler thread per GPU: no set-up races it)
}

OverlapPath::Channel& OverlapPath::GetChannel(Communicator& comm, std::string_view key, int kind) {
  const uint64_t key_hash = KeyHash(key);
  auto& c = channels_[{&comm, key_hash}];
  if (!c) {
    auto ch = std::make_unique<Channel>();
    ch->comm = &comm;
    ch->key_hash = key_hash;
    ch->key = std::string(key);
    ch->kind = kind;
    ch->nranks = comm.n;
    void* p = nullptr;
    OV_CUDA(cudaHostAlloc(&p, sizeof(Mailbox), cudaHostAllocPortable | cudaHostAllocMapped));
    std::memset(p, 0, sizeof(Mailbox));
    ch->mbox = static_cast<Mailbox*>(p);
    OV_CUDA(cudaHostAlloc(&p, kMaxRanks * sizeof(uint32_t), cudaHostAllocPortable | cudaHostAllocMapped));
    std::memset(p, 0, kMaxRanks * sizeof(uint32_t));
    ch->done = static_cast<uint32_t*>(p);
    ctx_.key_names[key_hash] = ch->key;
    c = std::move(ch);
  }
  return *c;
}

// First call of a rank: its persistent buffers and zeroed flags, complete
// before its first ready write (on the device's private stream, which never
// waits on XLA's); the communicator enabled peer access among its devices.
void OverlapPath::InitRank(Channel& c, int rank, size_t buf_bytes, size_t flag_words, size_t counter_words) {
  RankState& rs = c.ranks[rank];
  rs.ordinal = c.comm->ordinals[rank];
  gpu::Device& d = ctx_.GetDevice(rs.ordinal);
  DeviceGuard guard(rs.ordinal);
  OV_CUDA(cudaMalloc(&rs.buf, buf_bytes > 0 ? buf_bytes : 16));
  OV_CUDA(cudaMalloc(reinterpret_cast<void**>(&rs.flags), flag_words * sizeof(uint32_t)));
  OV_CUDA(cudaMalloc(reinterpret_cast<void**>(&rs.counter), counter_words * sizeof(uint32_t)));
  OV_CUDA(cudaMalloc(reinterpret_cast<void**>(&rs.ready_in), kMaxRanks * sizeof(uint32_t)));
  OV_CUDA(cudaMemsetAsync(rs.flags, 0, flag_words * sizeof(uint32_t), d.aux));
  OV_CUDA(cudaMemsetAsync(rs.counter, 0, counter_words * sizeof(uint32_t), d.aux));
  OV_CUDA(cudaMemsetAsync(rs.ready_in, 0, kMaxRanks * sizeof(uint32_t), d.aux));
  OV_CUDA(cudaStreamSynchronize(d.aux));
  // Published before this rank's first ready write is enqueued (peers read the
  // pointers only after seeing ready >= 1, or from their host once published).
  c.mbox->recv[rank] = reinterpret_cast<uint64_t>(rs.buf);
  c.mbox->flags[rank] = reinterpret_cast<uint64_t>(rs.flags);
  c.mbox->ready_in[rank] = reinterpret_cast<uint64_t>(rs.ready_in);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  rs.init = true;
}

OverlapPath::Call OverlapPath::Begin(cudaStream_t stream, int ordinal, std::string_view key, int kind,
                                     const std::vector<int>& devs, int rank, size_t buf_bytes, size_t flag_words,
                                     size_t counter_words) {
  Call call;
  {
    auto lk = ctx_.HandlerLock();
    DFCCL_CHECK_CODE(ctx_.cfg.configured, ErrorCode::kFailedPrecondition,
                     "dfccl: the GPU runtime was not configured (jax_dfccl._src.backend.load() passes every entry "
                     "of jax_dfccl.config)");
    std::vector<int64_t> group;
    for (int d : devs) group.push_back(ctx_.GlobalOf(d));
    Channel& c = GetChannel(ctx_.GetComm(group), key, kind);
    RankState& rs = c.ranks[rank];
    DFCCL_CHECK_CODE(!c.failed, ErrorCode::kAborted,
                     c.comm->InstanceName(c.key, rs.seq + 1) << " not run: its sequence " << c.failed_seq
                                                             << " failed earlier (" << c.error << ")");
    DFCCL_CHECK_CODE(c.kind == kind && (c.buf_bytes == 0 || c.buf_bytes == buf_bytes), ErrorCode::kFailedPrecondition,
                     c.comm->InstanceName(c.key, rs.seq + 1) << ": rank " << rank << " started it as "
                                                             << OpName(kind)
                                                             << " with other shapes than an earlier call of its key");
    c.buf_bytes = buf_bytes;
    if (!rs.init) InitRank(c, rank, buf_bytes, flag_words, counter_words);
    call.c = &c;
    call.rs = &rs;
    call.ordinal = ordinal;
    call.rank = rank;
    call.seq = ++rs.seq;
    call.timeout_ns = static_cast<int64_t>(ctx_.cfg.timeout_s * 1e9);
    for (int r = 0; r < c.nranks; ++r) {  // written by each rank's InitRank under the lock
      call.peer_buf[r] = c.ranks[r].init ? c.mbox->recv[r] : 0;
      call.peer_flags[r] = c.ranks[r].init ? c.mbox->flags[r] : 0;
      call.peer_ready[r] = c.ranks[r].init && r != rank ? c.mbox->ready_in[r] : 0;
    }
  }
  // Our previous instance is complete in stream order: peers may write again.
  // (A group of one has no peers to tell; the stream memop would also keep the
  // GEMM from launching before the previous kernel's end: GemmLaunch::pdl.)
  if (call.c->nranks > 1) StreamOps::Write32(stream, &call.c->mbox->ready[rank], call.seq);
  return call;
}

// On more than one rank the stream writes the done word after the instance
// (the proxy counts it completed from there).  A group of one waits for no
// peer and cannot time out: it counts as completed at once (a done write
// would also stop programmatic launch).
void OverlapPath::Commit(cudaStream_t stream, const Call& call) {
  Channel& c = *call.c;
  {
    auto lk = ctx_.HandlerLock();
    gpu::Device& d = ctx_.GetDevice(call.ordinal);
    ++d.fused_started;
    Trace(c, call.ordinal, call.seq, "start");
    if (c.nranks > 1) {
      call.rs->flights.push_back({call.seq, Clock::now(), {}, false});
    } else {
      Trace(c, call.ordinal, call.seq, "run");
      Trace(c, call.ordinal, call.seq, "finish");
      ++d.completed;
    }
  }
  if (c.nranks > 1) StreamOps::Write32(stream, &c.done[call.rank], call.seq);
}

void OverlapPath::Trace(const Channel& c, int ordinal, uint64_t seq, const char* event) {
  if (!ctx_.cfg.trace) return;
  ctx_.host_trace.push_back({ordinal, c.key_hash, seq, event, HostNs()});
  while (ctx_.host_trace.size() > kMaxHostTrace) ctx_.host_trace.pop_front();
}

// Ranks whose stream has not reached instance seq (their ready word, written
// in stream order at the instance's start: protocol.h).
std::vector<int> OverlapPath::Missing(const Channel& c, uint32_t seq) const {
  std::vector<int> out;
  for (int r = 0; r < c.nranks; ++r)
    if (!Reached(Load(&c.mbox->ready[r]), seq)) out.push_back(r);
  return out;
}

std::string OverlapPath::RankList(const Channel& c, const std::vector<int>& ranks) const {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i)
    os << (i ? ", " : "") << ranks[i] << " (GPU " << c.comm->ordinals[ranks[i]] << ")";
  os << "]";
  return os.str();
}

// Fails channel c at instance seq: every instance in flight on its local ranks
// fails; the message names key, sequence and the ranks whose streams never
// reached it; the error word makes every waiting kernel of the channel trap
// (protocol.h), so none returns a result.  The communicator records it (the
// group's devices' error, stats()["errors"], stderr); on the devices whose
// kernels trapped it stays until reset(), as a CUDA error does: that GPU's
// CUDA context is lost.
void OverlapPath::Fail(Channel& c, uint32_t seq, uint32_t kernel_code) {
  const std::vector<int> missing = Missing(c, seq);
  std::ostringstream why;
  why << "timed out after " << ctx_.cfg.timeout_s << " s: ";
  if (!missing.empty()) why << "rank(s) " << RankList(c, missing) << " never started it";
  else why << "every rank started it but it did not complete";
  why << " (fused " << OpName(c.kind);
  if (kernel_code != 0 && (kernel_code >> 24) != kWaitHostDeadline) why << "; " << DescribeCode(c, kernel_code);
  std::vector<int> local;  // this process's ranks with instances in flight: their kernels trap
  for (int r = 0; r < c.nranks; ++r)
    if (c.ranks[r].init && !c.ranks[r].flights.empty()) local.push_back(r);
  why << "; its kernels stopped (trap): the program running it failed on rank(s) " << RankList(c, local)
      << ", whose GPU's CUDA context is lost)";
  const std::string msg = c.comm->InstanceName(c.key, seq) + " " + why.str();
  if (Load(&c.mbox->error) == 0) {
    const int waiter = local.empty() ? 0 : local[0];
    *reinterpret_cast<volatile uint32_t*>(&c.mbox->error) =
        overlap::ErrorCode(kWaitHostDeadline, waiter, missing.empty() ? waiter : missing[0]);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  c.failed = true;
  c.failed_seq = seq;
  c.error = msg;
  for (int r : local) {
    gpu::Device& d = ctx_.GetDevice(c.ranks[r].ordinal);
    for (const Flight& f : c.ranks[r].flights) {
      Trace(c, d.ordinal, f.seq, "error");
      ++d.failed;
    }
    c.ranks[r].flights.clear();
  }
  c.comm->Fail(c.key_hash, seq, ErrorCode::kDeadlineExceeded, msg);
  for (int r : local) {
    gpu::Device& d = ctx_.GetDevice(c.ranks[r].ordinal);
    if (d.error.message == msg) d.error_once = false;
  }
}

// One look at channel c: completions (done words), streams that reached their
// instance, the deadline (config.timeout_s from the moment this rank's stream
// reached the instance) and errors the kernels recorded.
void OverlapPath::PollChannel(Channel& c, Clock::time_point now) {
  if (c.failed) return;
  const auto limit = std::chrono::duration<double>(ctx_.cfg.timeout_s);
  uint32_t oldest = 0;
  bool any = false, late = false;
  for (int r = 0; r < c.nranks; ++r) {
    RankState& rs = c.ranks[r];
    if (!rs.init) continue;
    const uint32_t done = Load(&c.done[r]), ready = Load(&c.mbox->ready[r]);
    while (!rs.flights.empty() && Reached(done, rs.flights.front().seq)) {
      const Flight& f = rs.flights.front();
      if (!f.has_reached) Trace(c, rs.ordinal, f.seq, "run");
      Trace(c, rs.ordinal, f.seq, "finish");
      ++ctx_.GetDevice(rs.ordinal).completed;
      rs.flights.pop_front();
    }
    for (Flight& f : rs.flights) {
      if (!f.has_reached && Reached(ready, f.seq)) {
        f.reached = now;
        f.has_reached = true;
        Trace(c, rs.ordinal, f.seq, "run");
      }
      if (!any || int32_t(f.seq - oldest) < 0) oldest = f.seq;
      any = true;
      late = late || (f.has_reached && now - f.reached > limit);
    }
  }
  if (!any) return;
  const uint32_t code = Load(&c.mbox->error);
  if (late || code != 0) Fail(c, oldest, code);
}

void OverlapPath::Poll(Clock::time_point now) {
  for (auto& [id, c] : channels_) PollChannel(*c, now);
}

bool OverlapPath::Busy() const { return Live() > 0; }

size_t OverlapPath::Live() const {
  size_t n = 0;
  for (auto& [id, c] : channels_)
    for (int r = 0; r < c->nranks; ++r) n += c->ranks[r].flights.size();
  return n;
}

// pending(): one line per fused instance in flight (key, sequence, rank and
// GPU, which ranks' streams reached it, whether this rank's did, and the ranks
// it waits for: the mailbox's ready words); failed channels with their error.
void OverlapPath::Describe(std::ostream& os, Clock::time_point now) {
  Poll(now);
  const auto ms = [&](Clock::time_point t) { return std::chrono::duration<double, std::milli>(now - t).count(); };
  for (auto& [id, cp] : channels_) {
    Channel& c = *cp;
    if (c.failed) {
      os << "fused " << OpName(c.kind) << " '" << c.key << "' failed at sequence " << c.failed_seq << ": " << c.error
         << "\n";
      continue;
    }
    for (int r = 0; r < c.nranks; ++r) {
      const RankState& rs = c.ranks[r];
      for (const Flight& f : rs.flights) {
        os << "GPU " << rs.ordinal << ": fused " << OpName(c.kind) << " " << c.comm->InstanceName(c.key, f.seq)
           << " rank " << r << ", " << ms(f.called) << " ms, started " << StartedMask(c, f.seq) << ", this stream ";
        if (!f.has_reached) {
          os << "not there yet\n";
          continue;
        }
        os << "reached it " << ms(f.reached) << " ms ago (fails at timeout_s " << ctx_.cfg.timeout_s << " s)";
        const std::vector<int> missing = Missing(c, f.seq);
        if (!missing.empty()) os << ", waiting for rank(s) " << RankList(c, missing) << ": never started it";
        else os << ", every rank started it";
        os << "\n";
      }
    }
  }
}

}  // namespace dfccl::gpu
