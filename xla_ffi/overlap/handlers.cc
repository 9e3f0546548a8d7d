// Host side of the fused overlap ops: channels (per device group and key),
// their persistent buffers and host-mapped mailbox, the FFI handlers, and what
// makes them collectives like the others (docs/design/overlap.md "Keys,
// counts and failures"): sequence numbers per (group, key), counts, the trace,
// the pending report, and failures with the runtime's codes and words.
// A handler never blocks on another device: it enqueues (ready write, kernels,
// done write) and returns; all cross-rank waits happen in the kernels, bounded
// by config.timeout_s (protocol.h); a watcher thread follows each instance
// through its rank's host-mapped ready and done words and fails it at the
// same bound.  Not command-buffer compatible (host work and a private side
// stream).
#include "overlap/handlers.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

#include "dfccl/check.h"
#include "ffi/error.h"
#include "overlap/launch.h"
#include "overlap/plan.h"
#include "overlap/profile.h"
#include "runtime/driver.h"

namespace ffi = xla::ffi;

namespace dfccl::overlap {
namespace {

struct Group {
  int rank = -1;
  std::vector<int> devs;
};

// One instance of a channel on one local rank, from its handler call to its
// completion (seen in the channel's done words) or failure.
struct Flight {
  uint32_t seq = 0;
  int64_t called_ns = 0;   // the handler enqueued it (system clock)
  int64_t reached_ns = 0;  // its stream reached it (ready word seen by the host; 0: not yet)
};

struct RankState {
  bool init = false;
  int ordinal = -1;
  void* buf = nullptr;        // AG: gather [P][m][K]; RS: recv [P][M/P][N]
  uint32_t* flags = nullptr;  // AG: [P][m tiles]; RS: [P][tiles of a row block]
  uint32_t* counter = nullptr;  // [0]: GEMM tile counter; AG: then [P-1][m tiles] push counters;
                                // RS: [1] done counter of the peer block's tiles (copy engine)
  uint32_t* ready_in = nullptr;  // [kMaxRanks]: the peers' announcements (protocol.h)
  uint32_t seq = 0;  // the sequence number of this rank's latest instance of the (group, key)
  uint32_t rs_ce_rounds = 0;  // RS copy-engine launches so far (done counter target / tiles)
  uint32_t tiles_taken = 0;  // GEMM tile counter value after all launches so far (units + clusters each)
  float* sk_partials = nullptr;  // split last wave: [SMs][kTileM * kTileNMax] f32 (allocated at its first use)
  uint32_t* sk_flags = nullptr;  // split last wave: [SMs] instance numbers
  std::deque<Flight> flights;    // instances in flight, oldest first
};

// A channel: the instances of one key on one device group (the collectives'
// identity: group, key, sequence), with their persistent buffers and mailbox.
struct ChannelId {
  std::vector<int> devs;  // the group's device ordinals in rank order
  std::string key;
  bool operator==(const ChannelId&) const = default;
};
struct ChannelIdHash {
  size_t operator()(const ChannelId& id) const {
    size_t h = std::hash<std::string>()(id.key);
    for (int d : id.devs) h = h * 1000003u ^ std::hash<int>()(d);
    return h;
  }
};

struct Channel {
  ChannelId id;
  int kind = 0;  // protocol.h Kind
  int nranks = 0;
  size_t buf_bytes = 0;       // of the first call (the key names the shapes and dtype)
  Mailbox* mbox = nullptr;    // host-mapped, portable
  uint32_t* done = nullptr;   // host-mapped [kMaxRanks]: rank p's stream wrote seq after instance seq
  bool failed = false;        // an instance timed out (the kernels trapped): no further call runs
  uint32_t failed_seq = 0;
  std::string error;          // its message
  RankState ranks[kMaxRanks];
  std::timed_mutex mu;
};

struct DeviceState {  // per device: side stream for the AG pushes
  cudaStream_t side = nullptr;
  cudaEvent_t start = nullptr, done = nullptr;
  int sms = 0;
  int cluster_ctas = 0;  // CTAs of the 2x1-cluster GEMM resident at once (both dtypes)
};

// Leaked, never destroyed: the watcher thread reads them until it is stopped
// at exit (StartWatcher), and static destructors do not wait for it.  Lock
// order: g_mu, then a channel's mu, then g_state_mu (a leaf).
std::timed_mutex& g_mu = *new std::timed_mutex;
auto& g_channels = *new std::unordered_map<ChannelId, std::unique_ptr<Channel>, ChannelIdHash>;
auto& g_devices = *new std::unordered_map<int, std::unique_ptr<DeviceState>>;

// What the fused ops add to the CUDA backend's stats(), trace and errors
// (docs/architecture.md), and the configuration they read.
struct TraceRec {
  int device;
  std::string key;
  uint64_t seq;
  const char* event;
  int64_t t_ns;
};
struct State {
  std::mutex mu;  // g_state_mu: everything below but the atomics
  bool configured = false;
  double timeout_s = 0;
  bool trace = false;
  int64_t trace_capacity = 0;
  std::deque<TraceRec> trace_ring;
  std::deque<std::string> errors;  // newest last, at most kMaxErrors
  std::map<int, Status> device_error;  // per local GPU: raised by its next fused call and raise_if_failed()
  std::atomic<bool> has_device_error{false};
  std::atomic<bool> trace_on{false};  // trace && trace_capacity > 0 (read without the lock)
  std::atomic<uint64_t> started{0}, completed{0}, failed{0};
};
State& g_state = *new State;
constexpr size_t kMaxErrors = 256;
constexpr uint32_t kWaitHostDeadline = 7;  // error word written by the host's deadline (not a kernel WaitWhat)

using prof::HostNowNs;
using prof::HostTimer;
using prof::Keep;
using prof::KeepTimeline;
using prof::Mark;
using prof::TimelineAlloc;

bool Reached(uint32_t value, uint32_t seq) { return int32_t(value - seq) >= 0; }
uint32_t Load(const uint32_t* p) { return *reinterpret_cast<const volatile uint32_t*>(p); }

void Trace(int device, const std::string& key, uint64_t seq, const char* event, int64_t t_ns) {
  if (!g_state.trace_on.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_state.mu);
  if (!g_state.trace || g_state.trace_capacity <= 0) return;
  g_state.trace_ring.push_back({device, key, seq, event, t_ns});
  while (g_state.trace_ring.size() > size_t(g_state.trace_capacity)) g_state.trace_ring.pop_front();
}

const char* OpName(int kind) { return kind == kAllGatherGemm ? "all_gather_matmul" : "matmul_reduce_scatter"; }

// The runtime's words for an instance (runtime/proxy.cc InstanceName).
std::string InstanceName(const Channel& c, uint64_t seq) {
  std::ostringstream os;
  os << "dfccl: collective '" << c.id.key << "' (sequence " << seq << ", group of GPUs [";
  for (size_t i = 0; i < c.id.devs.size(); ++i) os << (i ? "," : "") << c.id.devs[i];
  os << "])";
  return os.str();
}

std::string RankList(const Channel& c, const std::vector<int>& ranks) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i] << " (GPU " << c.id.devs[ranks[i]] << ")";
  os << "]";
  return os.str();
}

// Ranks whose stream has not reached instance seq (their ready word, written
// in stream order at the instance's start: protocol.h).
std::vector<int> Missing(const Channel& c, uint32_t seq) {
  std::vector<int> out;
  for (int r = 0; r < c.nranks; ++r)
    if (!Reached(Load(&c.mbox->ready[r]), seq)) out.push_back(r);
  return out;
}

std::string StartedMask(const Channel& c, uint32_t seq) {  // runtime/inspect.cc Mask
  std::string s;
  for (int r = 0; r < c.nranks; ++r) s += Reached(Load(&c.mbox->ready[r]), seq) ? 'S' : '.';
  return s;
}

// What a kernel's recorded error code says (protocol.h ErrorCode).
std::string DescribeCode(const Channel& c, uint32_t code) {
  static const char* what[] = {"?", "the ready flag (receive buffer free)", "partial tiles", "gathered rows",
                               "the ready flag (gather buffer free)", "its own partial tiles (local)",
                               "its own split tiles' partial accumulators (local)"};
  const uint32_t w = code >> 24, waiter = (code >> 16) & 0xff, peer = (code >> 8) & 0xff;
  std::ostringstream os;
  os << "rank " << waiter << " (GPU " << c.id.devs[waiter % c.id.devs.size()] << ") waited for "
     << what[w <= 6 ? w : 0] << " of rank " << peer << " (GPU " << c.id.devs[peer % c.id.devs.size()] << ")";
  return os.str();
}

void RecordError(const std::string& msg) {
  std::lock_guard<std::mutex> lock(g_state.mu);
  g_state.errors.push_back(msg);
  while (g_state.errors.size() > kMaxErrors) g_state.errors.pop_front();
}

// Fails channel c at instance seq (caller holds c.mu): every instance in
// flight on its local ranks fails; the host's message names key, sequence and
// the ranks whose streams never reached it; the error word makes every
// waiting kernel of the channel trap (protocol.h), so none returns a result.
void Fail(Channel& c, uint32_t seq, uint32_t kernel_code, int64_t now_ns) {
  double timeout_s;
  {
    std::lock_guard<std::mutex> lock(g_state.mu);
    timeout_s = g_state.timeout_s;
  }
  const std::vector<int> missing = Missing(c, seq);
  std::ostringstream why;
  why << "timed out after " << timeout_s << " s: ";
  if (!missing.empty()) why << "rank(s) " << RankList(c, missing) << " never started it";
  else why << "every rank started it but it did not complete";
  why << " (fused " << OpName(c.kind);
  if (kernel_code != 0 && (kernel_code >> 24) != kWaitHostDeadline) why << "; " << DescribeCode(c, kernel_code);
  std::vector<int> local;  // this process's ranks with instances in flight: their kernels trap
  for (int r = 0; r < c.nranks; ++r)
    if (c.ranks[r].init && !c.ranks[r].flights.empty()) local.push_back(r);
  why << "; its kernels stopped (trap): the program running it failed on rank(s) " << RankList(c, local)
      << ", whose GPU's CUDA context is lost)";
  const std::string msg = InstanceName(c, seq) + " " + why.str();
  if (Load(&c.mbox->error) == 0) {
    const int waiter = local.empty() ? 0 : local[0];
    *reinterpret_cast<volatile uint32_t*>(&c.mbox->error) =
        ErrorCode(kWaitHostDeadline, waiter, missing.empty() ? waiter : missing[0]);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  c.failed = true;
  c.failed_seq = seq;
  c.error = msg;
  uint64_t n = 0;
  for (int r : local) {
    for (const Flight& f : c.ranks[r].flights) {
      Trace(c.ranks[r].ordinal, c.id.key, f.seq, "error", now_ns);
      ++n;
    }
    c.ranks[r].flights.clear();
  }
  g_state.failed += n;
  RecordError(msg);
  {
    std::lock_guard<std::mutex> lock(g_state.mu);
    for (int r : local)
      if (g_state.device_error.count(c.ranks[r].ordinal) == 0)
        g_state.device_error[c.ranks[r].ordinal] = Status{::dfccl::ErrorCode::kDeadlineExceeded, msg};
    g_state.has_device_error.store(true, std::memory_order_release);
  }
  std::fprintf(stderr, "%s\n", msg.c_str());
}

// One look at channel c (caller holds c.mu): completions (done words), streams
// that reached their instance, the deadline (config.timeout_s from the moment
// this rank's stream reached the instance) and errors the kernels recorded.
void PollChannel(Channel& c, int64_t now_ns, double timeout_s) {
  if (c.failed) return;
  uint32_t oldest = 0;
  bool any = false, late = false;
  for (int r = 0; r < c.nranks; ++r) {
    RankState& rs = c.ranks[r];
    if (!rs.init) continue;
    const uint32_t done = Load(&c.done[r]), ready = Load(&c.mbox->ready[r]);
    while (!rs.flights.empty() && Reached(done, rs.flights.front().seq)) {
      const Flight& f = rs.flights.front();
      if (f.reached_ns == 0) Trace(rs.ordinal, c.id.key, f.seq, "run", now_ns);
      Trace(rs.ordinal, c.id.key, f.seq, "finish", now_ns);
      ++g_state.completed;
      rs.flights.pop_front();
    }
    for (Flight& f : rs.flights) {
      if (f.reached_ns == 0 && Reached(ready, f.seq)) {
        f.reached_ns = now_ns;
        Trace(rs.ordinal, c.id.key, f.seq, "run", now_ns);
      }
      if (!any || int32_t(f.seq - oldest) < 0) oldest = f.seq;
      any = true;
      late = late || (f.reached_ns != 0 && double(now_ns - f.reached_ns) > timeout_s * 1e9);
    }
  }
  if (!any) return;
  const uint32_t code = Load(&c.mbox->error);
  if (late || code != 0) Fail(c, oldest, code, now_ns);
}

std::vector<Channel*> Channels() {
  std::lock_guard<std::timed_mutex> lock(g_mu);
  std::vector<Channel*> out;
  for (auto& [id, c] : g_channels) out.push_back(c.get());
  return out;
}

double TimeoutS() {
  std::lock_guard<std::mutex> lock(g_state.mu);
  return g_state.timeout_s;
}

void PollAll() {
  const double timeout_s = TimeoutS();
  for (Channel* c : Channels()) {
    std::lock_guard<std::timed_mutex> lock(c->mu);
    PollChannel(*c, HostNowNs(), timeout_s);
  }
}

// The watcher: polls every channel (PollAll) while instances are in flight,
// so that a fused op completes, or fails at its deadline, without any later
// call.  Stopped and joined at exit, before CUDA's teardown (registered after
// it, at the first op, so run before it) unmaps the host words it reads.
void StartWatcher() {
  static std::once_flag once;
  static std::atomic<bool> stop{false};
  static std::thread* watcher = nullptr;
  std::call_once(once, [] {
    watcher = new std::thread([] {
      while (!stop.load(std::memory_order_relaxed)) {
        const bool busy = g_state.started.load() != g_state.completed.load() + g_state.failed.load();
        std::this_thread::sleep_for(std::chrono::microseconds(busy ? 250 : 2000));
        PollAll();
      }
    });
    std::atexit([] {
      stop = true;
      watcher->join();
    });
  });
}

// The device's recorded failure, raised by its next fused call (until reset()).
void ThrowIfFailed(int ordinal) {
  if (!g_state.has_device_error.load(std::memory_order_acquire)) return;
  Status s;
  {
    std::lock_guard<std::mutex> lock(g_state.mu);
    auto it = g_state.device_error.find(ordinal);
    if (it == g_state.device_error.end()) return;
    s = it->second;
  }
  s.Throw();
}

DeviceState& Device(int ordinal) {
  std::lock_guard<std::timed_mutex> lock(g_mu);
  auto& d = g_devices[ordinal];
  if (!d) {
    d = std::make_unique<DeviceState>();
    OV_CUDA(cudaStreamCreateWithFlags(&d->side, cudaStreamNonBlocking));
    OV_CUDA(cudaEventCreateWithFlags(&d->start, cudaEventDisableTiming));
    OV_CUDA(cudaEventCreateWithFlags(&d->done, cudaEventDisableTiming));
    OV_CUDA(cudaDeviceGetAttribute(&d->sms, cudaDevAttrMultiProcessorCount, ordinal));
    // Before anything of ours runs on the device (launch.h): every kernel loaded.
    OV_CUDA(PreloadGemmBF16());
    OV_CUDA(PreloadGemmF16());
    OV_CUDA(PreloadSideKernels());
    int bf16 = 0, f16 = 0;
    OV_CUDA(GemmClusterCtasBF16(&bf16));
    OV_CUDA(GemmClusterCtasF16(&f16));
    d->cluster_ctas = std::min(bf16, f16);
  }
  return *d;
}

Channel& GetChannel(std::string_view key, const Group& g, int kind) {
  ChannelId id{g.devs, std::string(key)};
  std::lock_guard<std::timed_mutex> lock(g_mu);
  auto& c = g_channels[id];
  if (!c) {
    c = std::make_unique<Channel>();
    c->id = std::move(id);
    c->kind = kind;
    c->nranks = static_cast<int>(g.devs.size());
    void* p = nullptr;
    OV_CUDA(cudaHostAlloc(&p, sizeof(Mailbox), cudaHostAllocPortable | cudaHostAllocMapped));
    std::memset(p, 0, sizeof(Mailbox));
    c->mbox = static_cast<Mailbox*>(p);
    OV_CUDA(cudaHostAlloc(&p, kMaxRanks * sizeof(uint32_t), cudaHostAllocPortable | cudaHostAllocMapped));
    std::memset(p, 0, kMaxRanks * sizeof(uint32_t));
    c->done = static_cast<uint32_t*>(p);
  }
  return *c;
}

// First call of a rank: its persistent buffers, zeroed flags (stream-ordered
// before its first ready write) and peer access to the group's other devices.
void InitRank(Channel& c, int rank, const std::vector<int>& devs, size_t buf_bytes, size_t flag_words,
              size_t counter_words, cudaStream_t stream) {
  RankState& rs = c.ranks[rank];
  rs.ordinal = devs[rank];
  dfccl::gpu::EnablePeerAccess(rs.ordinal, devs);  // runtime/driver.h (the handler made rs.ordinal current)
  OV_CUDA(cudaMalloc(&rs.buf, buf_bytes > 0 ? buf_bytes : 16));
  OV_CUDA(cudaMalloc(reinterpret_cast<void**>(&rs.flags), flag_words * sizeof(uint32_t)));
  OV_CUDA(cudaMalloc(reinterpret_cast<void**>(&rs.counter), counter_words * sizeof(uint32_t)));
  OV_CUDA(cudaMalloc(reinterpret_cast<void**>(&rs.ready_in), kMaxRanks * sizeof(uint32_t)));
  OV_CUDA(cudaMemsetAsync(rs.flags, 0, flag_words * sizeof(uint32_t), stream));
  OV_CUDA(cudaMemsetAsync(rs.counter, 0, counter_words * sizeof(uint32_t), stream));
  OV_CUDA(cudaMemsetAsync(rs.ready_in, 0, kMaxRanks * sizeof(uint32_t), stream));
  // Published before this rank's first ready write is enqueued (peers read the
  // pointers only after seeing ready >= 1, or from their host once published).
  c.mbox->recv[rank] = reinterpret_cast<uint64_t>(rs.buf);
  c.mbox->flags[rank] = reinterpret_cast<uint64_t>(rs.flags);
  c.mbox->ready_in[rank] = reinterpret_cast<uint64_t>(rs.ready_in);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  rs.init = true;
}

Group FindGroup(ffi::Span<const int64_t> devices, int32_t group_size, int32_t ordinal) {
  Group g;
  DFCCL_CHECK(group_size >= 1 && group_size <= kMaxRanks && devices.size() % group_size == 0,
              "dfccl overlap: group size " << group_size << " unsupported (1.." << kMaxRanks << ")");
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] != ordinal) continue;
    const size_t row = i / group_size;
    g.rank = static_cast<int>(i % group_size);
    for (int j = 0; j < group_size; ++j) g.devs.push_back(static_cast<int>(devices[row * group_size + j]));
    return g;
  }
  DFCCL_FAIL("dfccl overlap: GPU " << ordinal << " is in no group of the op");
}

// The local GEMM x @ w of a fused op: rows of x, inner and outer dimension.
struct GemmDims {
  int rows, inner, cols;
};
GemmDims CheckOperands(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const char* op, std::string_view key) {
  auto xd = x.dimensions(), wd = w.dimensions();
  DFCCL_CHECK(xd.size() == 2 && wd.size() == 2 && xd[1] == wd[0] && x.element_type() == w.element_type(),
              "dfccl overlap " << op << " '" << key << "': bad operand shapes");
  return {static_cast<int>(xd[0]), static_cast<int>(xd[1]), static_cast<int>(wd[1])};
}

using LaunchFn = cudaError_t (*)(const GemmLaunch&, cudaStream_t);

// Split-tile workspace of a rank (one slot per SM: sk_units <= avail <= SMs).
void EnsureSplit(RankState& rs, const DeviceState& dev, GemmLaunch& gl, cudaStream_t stream) {
  if (rs.sk_partials == nullptr) {
    OV_CUDA(cudaMalloc(reinterpret_cast<void**>(&rs.sk_partials), size_t(dev.sms) * kTileM * kTileNMax * sizeof(float)));
    OV_CUDA(cudaMalloc(reinterpret_cast<void**>(&rs.sk_flags), size_t(dev.sms) * sizeof(uint32_t)));
    OV_CUDA(cudaMemsetAsync(rs.sk_flags, 0, size_t(dev.sms) * sizeof(uint32_t), stream));
  }
  gl.sk_partials = rs.sk_partials;
  gl.sk_flags = rs.sk_flags;
}

// A launch's plan into its GemmLaunch; the split-tile workspace when used.
void ApplyPlan(const LaunchPlan& p, GemmLaunch& gl, RankState& rs, const DeviceState& dev, cudaStream_t stream) {
  gl.plan = p;
  if (p.sk_units > 0) EnsureSplit(rs, dev, gl, stream);
}

LaunchFn Dispatch(ffi::DataType t) {  // the one dtype table
  switch (t) {
    case ffi::DataType::BF16: return &LaunchGemmBF16;
    case ffi::DataType::F16: return &LaunchGemmF16;
    default: DFCCL_FAIL("dfccl overlap: unsupported element type " << static_cast<int>(t) << " (bf16/f16 only)");
  }
}

// Common part: channel, rank init, sequence number, ready write.
struct Prologue {
  Channel* c;
  RankState* rs;
  uint32_t seq;
  uint64_t peer_buf[kMaxRanks], peer_flags[kMaxRanks], peer_ready[kMaxRanks];  // 0: not initialized yet
};

Prologue Begin(cudaStream_t stream, std::string_view key, int kind, const Group& g, size_t buf_bytes,
               size_t flag_words, size_t counter_words) {
  Channel& c = GetChannel(key, g, kind);
  StartWatcher();
  std::lock_guard<std::timed_mutex> lock(c.mu);
  RankState& rs = c.ranks[g.rank];
  DFCCL_CHECK_CODE(!c.failed, ::dfccl::ErrorCode::kAborted,
                   InstanceName(c, rs.seq + 1) << " not run: its sequence " << c.failed_seq
                                               << " failed earlier (" << c.error << ")");
  DFCCL_CHECK_CODE(c.kind == kind && (c.buf_bytes == 0 || c.buf_bytes == buf_bytes),
                   ::dfccl::ErrorCode::kFailedPrecondition,
                   InstanceName(c, rs.seq + 1) << ": rank " << g.rank << " started it as " << OpName(kind)
                                               << " with other shapes than an earlier call of its key");
  c.buf_bytes = buf_bytes;
  if (!rs.init) InitRank(c, g.rank, g.devs, buf_bytes, flag_words, counter_words, stream);
  const uint32_t seq = ++rs.seq;
  // Our previous instance is complete in stream order: peers may write again.
  // (A group of one has no peers to tell; the stream memop would also keep the
  // GEMM from launching before the previous kernel's end: GemmLaunch::pdl.)
  if (c.nranks > 1) dfccl::gpu::StreamOps::Write32(stream, &c.mbox->ready[g.rank], seq);
  Prologue p{&c, &rs, seq, {}, {}, {}};
  for (int r = 0; r < c.nranks; ++r) {  // written by each rank's InitRank under c.mu
    p.peer_buf[r] = c.ranks[r].init ? c.mbox->recv[r] : 0;
    p.peer_flags[r] = c.ranks[r].init ? c.mbox->flags[r] : 0;
    p.peer_ready[r] = c.ranks[r].init && r != g.rank ? c.mbox->ready_in[r] : 0;
  }
  return p;
}

// The instance is enqueued: counted as started; on more than one rank its
// stream writes the done word after it (the watcher counts it completed from
// there).  A group of one waits for no peer and cannot time out: it counts as
// completed at once (a done write would also stop programmatic launch).
void Commit(cudaStream_t stream, const Prologue& pro, int rank) {
  Channel& c = *pro.c;
  const int64_t now = HostNowNs();
  std::lock_guard<std::timed_mutex> lock(c.mu);
  ++g_state.started;
  Trace(pro.rs->ordinal, c.id.key, pro.seq, "start", now);
  if (c.nranks > 1) {
    dfccl::gpu::StreamOps::Write32(stream, &c.done[rank], pro.seq);
    pro.rs->flights.push_back({pro.seq, now, 0});
  } else {
    Trace(pro.rs->ordinal, c.id.key, pro.seq, "run", now);
    Trace(pro.rs->ordinal, c.id.key, pro.seq, "finish", now);
    ++g_state.completed;
  }
}

// The peers' addresses known here (the kernels' fast path, protocol.h); none
// with kModeMailboxOnly.
void PeerAddresses(const Prologue& pro, int nranks, int32_t mode, GemmLaunch& gl) {
  if (mode & kModeMailboxOnly) return;
  for (int r = 0; r < nranks; ++r) {
    gl.peer_recv[r] = pro.peer_buf[r];
    gl.peer_flags[r] = pro.peer_flags[r];
    gl.peer_ready[r] = reinterpret_cast<uint32_t*>(pro.peer_ready[r]);
  }
  gl.ready_in = pro.rs->ready_in;
}

// Copy-engine transfer on the side stream (protocol.h): wait for the peer's
// ready (and *counter >= target), copy `bytes` from src to the peer's buffer at
// dst_off, then raise the peer's flag words [flag_off, flag_off + count).
void SideCopy(cudaStream_t side, const Prologue& pro, int rank, int d, const void* src, size_t dst_off, size_t bytes,
              size_t flag_off, int count, const uint32_t* counter, uint32_t target, uint64_t timeout_ns,
              uint64_t* tl, int32_t mode) {
  SideSync ss;
  ss.mbox = pro.c->mbox; ss.rank = rank; ss.peer = d; ss.seq = pro.seq; ss.timeout_ns = timeout_ns;
  ss.flags = reinterpret_cast<uint32_t*>(pro.peer_flags[d]) + flag_off;
  ss.count = count; ss.counter = counter; ss.target = target; ss.tl = tl;
  ss.ready_local = (mode & kModeMailboxOnly) ? nullptr : pro.rs->ready_in + d;
  OV_CUDA(LaunchReadyWait(ss, side));
  OV_CUDA(cudaMemcpyAsync(reinterpret_cast<char*>(pro.peer_buf[d]) + dst_off, src, bytes, cudaMemcpyDeviceToDevice,
                          side));
  OV_CUDA(LaunchSignal(ss, side));
}

// The bound of every wait of a fused op's kernels: jax_dfccl.config.timeout_s,
// the one user timeout (the host fails the instance at the same bound,
// counted from the moment this rank's stream reached it: PollChannel).
int64_t ConfiguredTimeoutNs() {
  std::lock_guard<std::mutex> lock(g_state.mu);
  DFCCL_CHECK_CODE(g_state.configured, ::dfccl::ErrorCode::kFailedPrecondition,
                   "dfccl overlap: the runtime was not configured (jax_dfccl.config is applied when "
                   "jax_dfccl._src.overlap_gpu loads the module)");
  return static_cast<int64_t>(g_state.timeout_s * 1e9);
}

ffi::Error AgImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> xg, std::string_view key,
                  ffi::Span<const int64_t> devices, int32_t group_size, int32_t mode) {
  return dfccl::FfiGuard([&] {
    ThrowIfFailed(ordinal);
    const int64_t timeout_ns = ConfiguredTimeoutNs();
    HostTimer host_timer(key);
    const int64_t host_ns = prof::Profiling() ? prof::HostNowNs() : 0;  // enqueue time (timeline)
    DeviceGuard guard(ordinal);
    const Group g = FindGroup(devices, group_size, ordinal);
    const int P = static_cast<int>(g.devs.size());
    const bool no_comm = prof::NoComm();
    const auto [m, K, n] = CheckOperands(x, w, "AG", key);
    DFCCL_CHECK(K % 8 == 0 && n % 8 == 0 && m > 0, "dfccl overlap AG '" << key << "': K and n must be multiples of 8");
    const LaunchFn launch = Dispatch(x.element_type());
    const size_t esz = 2, mtiles = (m + kTileM - 1) / kTileM;
    DeviceState& dev = Device(ordinal);
    auto pro = Begin(stream, key, kAllGatherGemm, g, size_t(P) * m * K * esz, P * mtiles, 1 + P * mtiles);
    // Pushes of our rows to the peers, on the side stream after the ready write.
    PushLaunch pl;
    pl.x = x.untyped_data(); pl.m = m; pl.row_bytes = K * esz; pl.rank = g.rank; pl.nranks = P;
    pl.mbox = pro.c->mbox; pl.seq = pro.seq; pl.timeout_ns = uint64_t(timeout_ns);
    pl.counters = pro.rs->counter + 1;
    pl.ready_in = (mode & kModeMailboxOnly) ? nullptr : pro.rs->ready_in;
    const bool push = P > 1 && !no_comm;
    // Copy engine once every peer's buffers are known here (from their first
    // call on); else the SM push kernel, which finds them in the mailbox.
    bool ce = (mode & kModeCopyEngine) != 0;
    for (int r = 0; r < P; ++r) ce = ce && pro.peer_buf[r] != 0 && pro.peer_flags[r] != 0;
    const int push_ctas = ce ? 0 : std::min<int>(16, (P - 1) * mtiles * 4);  // 4: pieces per chunk (push.cu)
    pl.grid = push_ctas;
    const LaunchPlan plan =
        PlanLaunch(kAllGatherGemm, P, m, n, K, dev.sms - (push ? std::max(push_ctas, 1) : 0), dev.cluster_ctas, mode);
    const int tiles = plan.tiles;
    uint64_t* tl = TimelineAlloc(stream, size_t(tiles) * kTlWords + size_t(kMaxRanks) * kTlSide);
    if (push) {
      OV_CUDA(cudaEventRecord(dev.start, stream));
      OV_CUDA(cudaStreamWaitEvent(dev.side, dev.start, 0));
      cudaEvent_t p0 = Mark(dev.side);
      if (ce) {
        const size_t blk = size_t(m) * K * esz;
        for (int j = 1; j < P; ++j) {  // rank-1 needs our rows first (right after its own block)
          const int d = (g.rank - j + P) % P;
          SideCopy(dev.side, pro, g.rank, d, x.untyped_data(), size_t(g.rank) * blk, blk, size_t(g.rank) * mtiles,
                   int(mtiles), nullptr, 0, uint64_t(timeout_ns),
                   tl ? tl + size_t(tiles) * kTlWords + size_t(j - 1) * kTlSide : nullptr, mode);
        }
      } else {
        OV_CUDA(LaunchPush(pl, dev.side));
      }
      Keep(key, ce ? "|copy" : "|push", p0, Mark(dev.side));
      OV_CUDA(cudaEventRecord(dev.done, dev.side));
    }
    GemmLaunch gl;
    gl.kind = kAllGatherGemm; gl.rank = g.rank; gl.nranks = P; gl.mb = m; gl.n = n; gl.k = K;
    for (int b = 0; b < P; ++b)
      gl.a[b] = b == g.rank ? x.untyped_data() : static_cast<char*>(pro.rs->buf) + size_t(b) * m * K * esz;
    gl.w = w.untyped_data(); gl.out = out->untyped_data();
    gl.local_flags = pro.rs->flags; gl.tile_counter = pro.rs->counter; gl.mbox = pro.c->mbox;
    gl.seq = pro.seq; gl.timeout_ns = uint64_t(timeout_ns); gl.no_comm = no_comm; gl.tl = tl;
    PeerAddresses(pro, P, mode, gl);
    // Copy engine: one SM stays free for the side stream's wait / signal kernels
    // (the persistent GEMM's CTAs wait for flags those kernels raise).
    ApplyPlan(plan, gl, *pro.rs, dev, stream);
    gl.tile_base = pro.rs->tiles_taken;
    pro.rs->tiles_taken += uint32_t(gl.plan.units + gl.plan.grid / gl.plan.cluster_m);
    cudaEvent_t g0 = Mark(stream);
    OV_CUDA(launch(gl, stream));
    Keep(key, no_comm ? "|gemm_nocomm" : "|gemm", g0, Mark(stream));
    if (push) OV_CUDA(cudaStreamWaitEvent(stream, dev.done, 0));
    if (tl) KeepTimeline({std::string(key), ordinal, kAllGatherGemm, g.rank, P, tiles / P, tiles, gl.plan.grid,
                          push && ce ? P - 1 : 0, tl, nullptr, host_ns}, stream);
    if (xg->element_count() > 0) {  // all_gather(x) for the VJP: own rows + received slots
      char* dst = static_cast<char*>(xg->untyped_data());
      const size_t blk = size_t(m) * K * esz;
      for (int b = 0; b < P; ++b)
        OV_CUDA(cudaMemcpyAsync(dst + b * blk, gl.a[b], blk, cudaMemcpyDeviceToDevice, stream));
    }
    Commit(stream, pro, g.rank);
  });
}

ffi::Error RsImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Result<ffi::AnyBuffer> out, std::string_view key, ffi::Span<const int64_t> devices,
                  int32_t group_size, int32_t mode) {
  return dfccl::FfiGuard([&] {
    ThrowIfFailed(ordinal);
    const int64_t timeout_ns = ConfiguredTimeoutNs();
    HostTimer host_timer(key);
    const int64_t host_ns = prof::Profiling() ? prof::HostNowNs() : 0;  // enqueue time (timeline)
    DeviceGuard guard(ordinal);
    const Group g = FindGroup(devices, group_size, ordinal);
    const int P = static_cast<int>(g.devs.size());
    const auto [M, k, N] = CheckOperands(x, w, "RS", key);
    DFCCL_CHECK(M % P == 0 && k % 8 == 0 && N % 8 == 0,
                "dfccl overlap RS '" << key << "': M must divide by the ranks, k and N be multiples of 8");
    const int mb = M / P;
    const LaunchFn launch = Dispatch(x.element_type());
    const size_t esz = 2;
    const int mtiles = (mb + kTileM - 1) / kTileM;
    DeviceState& dev = Device(ordinal);
    // Flags for the narrowest tiles (the most per block), whatever this call picks.
    auto pro = Begin(stream, key, kGemmReduceScatter, g, size_t(P) * mb * N * esz,
                     size_t(P) * mtiles * ((N + kTileNMin - 1) / kTileNMin), 1 + P);
    const bool no_comm = prof::NoComm();
    // Copy engine (2 ranks, every rank's buffers known): the peer block goes to
    // our own (unused) recv slot, the side stream moves it once complete.
    bool ce = (mode & kModeRsCopyEngine) != 0 && P == 2 && !no_comm;
    for (int r = 0; r < P; ++r) ce = ce && pro.peer_buf[r] != 0 && pro.peer_flags[r] != 0;
    GemmLaunch gl;
    gl.kind = kGemmReduceScatter; gl.rank = g.rank; gl.nranks = P; gl.mb = mb; gl.n = N; gl.k = k;
    for (int b = 0; b < P; ++b) gl.a[b] = static_cast<const char*>(x.untyped_data()) + size_t(b) * mb * k * esz;
    // Copy engine: one SM stays free for the side stream's wait / signal kernels.
    const LaunchPlan plan = PlanLaunch(kGemmReduceScatter, P, mb, N, k, dev.sms - (ce ? 1 : 0), dev.cluster_ctas, mode);
    const int per_block = plan.tiles / P;
    gl.w = w.untyped_data(); gl.out = out->untyped_data(); gl.local_recv = pro.rs->buf;
    gl.local_flags = pro.rs->flags; gl.tile_counter = pro.rs->counter; gl.mbox = pro.c->mbox;
    gl.seq = pro.seq; gl.timeout_ns = uint64_t(timeout_ns); gl.no_comm = no_comm;
    gl.thread_fences = (mode & kModeCtaFence) ? 0 : 1;
    PeerAddresses(pro, P, mode, gl);
    gl.tl = TimelineAlloc(stream, size_t(P) * per_block * kTlWords + size_t(kMaxRanks) * kTlSide);
    const size_t blk = size_t(mb) * N * esz;
    if (ce) {
      const int d = (g.rank + 1) % P;
      gl.send = static_cast<char*>(pro.rs->buf) + size_t(g.rank) * blk;
      gl.done_counter = pro.rs->counter + 1;
      const uint32_t target = ++pro.rs->rs_ce_rounds * uint32_t(per_block);
      OV_CUDA(cudaEventRecord(dev.start, stream));
      OV_CUDA(cudaStreamWaitEvent(dev.side, dev.start, 0));
      cudaEvent_t p0 = Mark(dev.side);
      SideCopy(dev.side, pro, g.rank, d, gl.send, size_t(g.rank) * blk, blk, size_t(g.rank) * per_block, per_block,
               gl.done_counter, target, uint64_t(timeout_ns),
               gl.tl ? gl.tl + size_t(P) * per_block * kTlWords : nullptr, mode);
      Keep(key, "|copy", p0, Mark(dev.side));
      OV_CUDA(cudaEventRecord(dev.done, dev.side));
    }
    ApplyPlan(plan, gl, *pro.rs, dev, stream);
    gl.tile_base = pro.rs->tiles_taken;
    pro.rs->tiles_taken += uint32_t(gl.plan.units + gl.plan.grid / gl.plan.cluster_m);
    cudaEvent_t g0 = Mark(stream);
    OV_CUDA(launch(gl, stream));
    Keep(key, gl.no_comm ? "|gemm_nocomm" : "|gemm", g0, Mark(stream));
    if (ce) OV_CUDA(cudaStreamWaitEvent(stream, dev.done, 0));
    if (gl.tl) KeepTimeline({std::string(key), ordinal, kGemmReduceScatter, g.rank, P, per_block, P * per_block,
                             gl.plan.grid, ce ? 1 : 0, gl.tl, nullptr, host_ns}, stream);
    Commit(stream, pro, g.rank);
  });
}

}  // namespace

void Configure(const std::optional<double>& timeout_s, const std::optional<bool>& trace,
               const std::optional<int64_t>& trace_capacity) {
  DFCCL_CHECK(!timeout_s || (*timeout_s > 0 && *timeout_s < 1e9),
              "dfccl overlap: timeout_s must be > 0 seconds, got " << *timeout_s);
  DFCCL_CHECK(!trace_capacity || (*trace_capacity >= 0 && *trace_capacity <= (int64_t(1) << 26)),
              "dfccl overlap: trace_capacity must be in [0, 2^26], got " << *trace_capacity);
  std::lock_guard<std::mutex> lock(g_state.mu);
  if (timeout_s) g_state.timeout_s = *timeout_s;
  if (trace) g_state.trace = *trace;
  if (trace_capacity) g_state.trace_capacity = *trace_capacity;
  g_state.configured = g_state.configured || (timeout_s && trace && trace_capacity);
  g_state.trace_on.store(g_state.trace && g_state.trace_capacity > 0, std::memory_order_relaxed);
  while (g_state.trace_ring.size() > size_t(g_state.trace_capacity)) g_state.trace_ring.pop_front();
}

ConfigValues Config() {
  std::lock_guard<std::mutex> lock(g_state.mu);
  return {g_state.timeout_s, g_state.trace, g_state.trace_capacity};
}

Stats GetStats() {
  PollAll();
  Stats s;
  size_t live = 0;
  for (Channel* c : Channels()) {
    std::lock_guard<std::timed_mutex> lock(c->mu);
    for (int r = 0; r < c->nranks; ++r) live += c->ranks[r].flights.size();
    ++s.channels;
  }
  std::lock_guard<std::mutex> lock(g_state.mu);
  s.completed = g_state.completed.load();
  s.failed = g_state.failed.load();
  s.started = g_state.started.load();
  s.instances_live = live;
  s.trace_records = g_state.trace_ring.size();
  s.errors.assign(g_state.errors.begin(), g_state.errors.end());
  return s;
}

std::vector<TraceRecord> TraceRecords() {
  PollAll();
  std::lock_guard<std::mutex> lock(g_state.mu);
  std::vector<TraceRecord> out;
  for (const TraceRec& r : g_state.trace_ring) out.push_back({r.device, r.key, r.seq, r.event, r.t_ns});
  return out;
}

std::string Pending(int wait_ms) {
  const auto wait = std::chrono::milliseconds(wait_ms);
  std::unique_lock<std::timed_mutex> glock(g_mu, wait);
  if (!glock.owns_lock()) return "fused ops: lock held for " + std::to_string(wait_ms) + " ms\n";
  std::vector<Channel*> chans;
  for (auto& [id, c] : g_channels) chans.push_back(c.get());
  glock.unlock();
  const double timeout_s = TimeoutS();
  std::ostringstream os;
  for (Channel* cp : chans) {
    Channel& c = *cp;
    std::unique_lock<std::timed_mutex> lock(c.mu, wait);
    if (!lock.owns_lock()) {
      os << "fused " << OpName(c.kind) << " '" << c.id.key << "': its lock is held for " << wait_ms << " ms\n";
      continue;
    }
    const int64_t now = HostNowNs();
    PollChannel(c, now, timeout_s);
    if (c.failed) {
      os << "fused " << OpName(c.kind) << " '" << c.id.key << "' failed at sequence " << c.failed_seq << ": "
         << c.error << "\n";
      continue;
    }
    for (int r = 0; r < c.nranks; ++r) {
      const RankState& rs = c.ranks[r];
      for (const Flight& f : rs.flights) {
        os << "GPU " << rs.ordinal << ": fused " << OpName(c.kind) << " " << InstanceName(c, f.seq) << " rank " << r
           << ", " << double(now - f.called_ns) / 1e6 << " ms, started " << StartedMask(c, f.seq) << ", this stream ";
        if (f.reached_ns == 0) {
          os << "not there yet\n";
          continue;
        }
        os << "reached it " << double(now - f.reached_ns) / 1e6 << " ms ago (fails at timeout_s " << timeout_s
           << " s)";
        const std::vector<int> missing = Missing(c, f.seq);
        if (!missing.empty()) os << ", waiting for rank(s) " << RankList(c, missing) << ": never started it";
        else os << ", every rank started it";
        os << "\n";
      }
    }
  }
  return os.str();
}

void RaiseIfFailed() {
  PollAll();
  Status s;
  {
    std::lock_guard<std::mutex> lock(g_state.mu);
    if (g_state.device_error.empty()) return;
    s = g_state.device_error.begin()->second;
  }
  s.Throw();
}

void Reset() {
  PollAll();
  std::lock_guard<std::mutex> lock(g_state.mu);
  g_state.device_error.clear();
  g_state.has_device_error.store(false, std::memory_order_release);
  g_state.errors.clear();
  g_state.trace_ring.clear();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OverlapAgCuda, AgImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // x [m, K]
                                  .Arg<ffi::AnyBuffer>()  // w [K, n]
                                  .Ret<ffi::AnyBuffer>()  // out [P*m, n]
                                  .Ret<ffi::AnyBuffer>()  // xg [P*m, K] or [0, K]
                                  .Attr<std::string_view>("key")
                                  .Attr<ffi::Span<const int64_t>>("devices")
                                  .Attr<int32_t>("group_size")
                                  .Attr<int32_t>("mode"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OverlapRsCuda, RsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, k]
                                  .Arg<ffi::AnyBuffer>()  // w [k, N]
                                  .Ret<ffi::AnyBuffer>()  // out [M/P, N]
                                  .Attr<std::string_view>("key")
                                  .Attr<ffi::Span<const int64_t>>("devices")
                                  .Attr<int32_t>("group_size")
                                  .Attr<int32_t>("mode"));

}  // namespace dfccl::overlap
