// Host side of the fused overlap ops: channels (per op key and device group),
// their persistent buffers and host-mapped mailbox, and the FFI handlers.
// A handler never blocks on another device: it enqueues (ready write, kernels)
// and returns; all cross-rank waits happen in the kernels, bounded (protocol.h).
// Not command-buffer compatible (host work and a private side stream).
#include "overlap/handlers.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
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

struct RankState {
  bool init = false;
  int ordinal = -1;
  void* buf = nullptr;        // AG: gather [P][m][K]; RS: recv [P][M/P][N]
  uint32_t* flags = nullptr;  // AG: [P][m tiles]; RS: [P][tiles of a row block]
  uint32_t* counter = nullptr;  // [0]: GEMM tile counter; AG: then [P-1][m tiles] push counters;
                                // RS: [1] done counter of the peer block's tiles (copy engine)
  uint32_t* ready_in = nullptr;  // [kMaxRanks]: the peers' announcements (protocol.h)
  uint32_t seq = 0;
  uint32_t rs_ce_rounds = 0;  // RS copy-engine launches so far (done counter target / tiles)
  uint32_t tiles_taken = 0;  // GEMM tile counter value after all launches so far (units + clusters each)
  float* sk_partials = nullptr;  // split last wave: [SMs][kTileM * kTileNMax] f32 (allocated at its first use)
  uint32_t* sk_flags = nullptr;  // split last wave: [SMs] instance numbers
};

struct Channel {
  std::string key;
  int nranks = 0;
  Mailbox* mbox = nullptr;  // host-mapped, portable
  uint64_t timeout_ns = 0;  // of the latest call (for messages)
  bool reported = false;    // the watcher printed its error (guarded by g_mu)
  RankState ranks[kMaxRanks];
  std::mutex mu;
};

struct DeviceState {  // per device: side stream for the AG pushes
  cudaStream_t side = nullptr;
  cudaEvent_t start = nullptr, done = nullptr;
  int sms = 0;
  int cluster_ctas = 0;  // CTAs of the 2x1-cluster GEMM resident at once (both dtypes)
};

// Leaked, never destroyed: the watcher thread reads them until it is stopped
// at exit (StartWatcher), and static destructors do not wait for it.
std::mutex& g_mu = *new std::mutex;
auto& g_channels = *new std::unordered_map<std::string, std::unique_ptr<Channel>>;
auto& g_devices = *new std::unordered_map<int, std::unique_ptr<DeviceState>>;

using prof::HostTimer;
using prof::Keep;
using prof::KeepTimeline;
using prof::Mark;
using prof::TimelineAlloc;

DeviceState& Device(int ordinal) {
  std::lock_guard<std::mutex> lock(g_mu);
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

Channel& GetChannel(const std::string& key, int nranks) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& c = g_channels[key];
  if (!c) {
    c = std::make_unique<Channel>();
    c->key = key;
    c->nranks = nranks;
    void* p = nullptr;
    OV_CUDA(cudaHostAlloc(&p, sizeof(Mailbox), cudaHostAllocPortable | cudaHostAllocMapped));
    std::memset(p, 0, sizeof(Mailbox));
    c->mbox = static_cast<Mailbox*>(p);
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

std::string Describe(const Channel& c, uint32_t code) {
  static const char* what[] = {"?", "the ready flag (receive buffer free)", "partial tiles", "gathered rows",
                               "the ready flag (gather buffer free)", "its own partial tiles (local)",
                               "its own split tiles' partial accumulators (local)"};
  const uint32_t w = code >> 24, waiter = (code >> 16) & 0xff, peer = (code >> 8) & 0xff;
  std::ostringstream os;
  os << "dfccl overlap '" << c.key << "': rank " << waiter << " (GPU " << c.ranks[waiter % kMaxRanks].ordinal
     << ") timed out after " << c.timeout_ns / 1000000 << " ms waiting for " << what[w <= 6 ? w : 0]
     << " of rank " << peer << " (GPU " << c.ranks[peer % kMaxRanks].ordinal
     << "); the op's kernels stopped (trap), so the program running it failed and that GPU's CUDA context is "
        "lost (protocol.h)";
  return os.str();
}

// The watcher: prints each channel's recorded timeout once, as soon as it
// appears in the (host-mapped) mailbox.  The kernels trap right after
// recording it (protocol.h), so the failing program's own error names only the
// CUDA failure; this line names the op key and the ranks.  Stopped and joined
// at exit, before CUDA's teardown (registered after it, at the first op, so
// run before it) unmaps the mailboxes it reads.
void StartWatcher() {
  static std::once_flag once;
  static std::atomic<bool> stop{false};
  static std::thread* watcher = nullptr;
  std::call_once(once, [] {
    watcher = new std::thread([] {
      while (!stop.load(std::memory_order_relaxed)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        std::vector<std::string> found;
        {
          std::lock_guard<std::mutex> lock(g_mu);
          for (auto& [k, c] : g_channels) {
            const uint32_t err = *reinterpret_cast<volatile uint32_t*>(&c->mbox->error);
            if (err != 0 && !c->reported) {
              c->reported = true;
              found.push_back(Describe(*c, err));
            }
          }
        }
        for (const std::string& m : found) std::fprintf(stderr, "%s\n", m.c_str());
      }
    });
    std::atexit([] {
      stop = true;
      watcher->join();
    });
  });
}

struct Group {
  int rank = -1;
  std::vector<int> devs;
};

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

std::string ChannelKey(std::string_view key, const Group& g, ffi::DataType t) {  // every call: no stream
  std::string s(key);
  s += "|t" + std::to_string(static_cast<int>(t)) + "|g";
  for (int d : g.devs) s += std::to_string(d) + ",";
  return s;
}

// Common part: channel, rank init, seq, error check, ready write.
struct Prologue {
  Channel* c;
  RankState* rs;
  uint32_t seq;
  uint64_t peer_buf[kMaxRanks], peer_flags[kMaxRanks], peer_ready[kMaxRanks];  // 0: not initialized yet
};

Prologue Begin(cudaStream_t stream, const std::string& key, const Group& g, size_t buf_bytes, size_t flag_words,
               size_t counter_words, uint64_t timeout_ns) {
  Channel& c = GetChannel(key, static_cast<int>(g.devs.size()));
  StartWatcher();
  std::lock_guard<std::mutex> lock(c.mu);
  c.timeout_ns = timeout_ns;
  if (!c.ranks[g.rank].init) InitRank(c, g.rank, g.devs, buf_bytes, flag_words, counter_words, stream);
  const uint32_t err = *reinterpret_cast<volatile uint32_t*>(&c.mbox->error);
  DFCCL_CHECK_CODE(err == 0, ::dfccl::ErrorCode::kDeadlineExceeded, "an earlier call failed: " << Describe(c, err));
  const uint32_t seq = ++c.ranks[g.rank].seq;
  // Our previous instance is complete in stream order: peers may write again.
  // (A group of one has no peers to tell; the stream memop would also keep the
  // GEMM from launching before the previous kernel's end: GemmLaunch::pdl.)
  if (c.nranks > 1) dfccl::gpu::StreamOps::Write32(stream, &c.mbox->ready[g.rank], seq);
  Prologue p{&c, &c.ranks[g.rank], seq, {}, {}, {}};
  for (int r = 0; r < c.nranks; ++r) {  // written by each rank's InitRank under c.mu
    p.peer_buf[r] = c.ranks[r].init ? c.mbox->recv[r] : 0;
    p.peer_flags[r] = c.ranks[r].init ? c.mbox->flags[r] : 0;
    p.peer_ready[r] = c.ranks[r].init && r != g.rank ? c.mbox->ready_in[r] : 0;
  }
  return p;
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

ffi::Error AgImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> xg, std::string_view key,
                  ffi::Span<const int64_t> devices, int32_t group_size, int64_t timeout_ns, int32_t mode) {
  return dfccl::FfiGuard([&] {
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
    auto pro = Begin(stream, ChannelKey(key, g, x.element_type()), g, size_t(P) * m * K * esz, P * mtiles,
                     1 + P * mtiles, uint64_t(timeout_ns));
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
  });
}

ffi::Error RsImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Result<ffi::AnyBuffer> out, std::string_view key, ffi::Span<const int64_t> devices,
                  int32_t group_size, int64_t timeout_ns, int32_t mode) {
  return dfccl::FfiGuard([&] {
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
    auto pro = Begin(stream, ChannelKey(key, g, x.element_type()), g, size_t(P) * mb * N * esz,
                     size_t(P) * mtiles * ((N + kTileNMin - 1) / kTileNMin), 1 + P, uint64_t(timeout_ns));
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
  });
}

}  // namespace

std::vector<std::string> Errors() {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto& [k, c] : g_channels) {
    const uint32_t err = *reinterpret_cast<volatile uint32_t*>(&c->mbox->error);
    if (err) out.push_back(Describe(*c, err));
  }
  return out;
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
                                  .Attr<int64_t>("timeout_ns")
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
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int32_t>("mode"));

}  // namespace dfccl::overlap
