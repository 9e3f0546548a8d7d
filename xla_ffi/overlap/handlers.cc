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
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "dfccl/check.h"
#include "overlap/launch.h"
#include "runtime/driver.h"

namespace ffi = xla::ffi;

namespace dfccl::overlap {
namespace {

#define OV_CUDA(call)                                                                      \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    DFCCL_CHECK(e_ == cudaSuccess, "dfccl overlap: " #call " failed: " << cudaGetErrorString(e_)); \
  } while (0)

struct RankState {
  bool init = false;
  int ordinal = -1;
  void* buf = nullptr;        // AG: gather [P][m][K]; RS: recv [P][M/P][N]
  uint32_t* flags = nullptr;  // AG: [P][m tiles]; RS: [P][tiles of a row block]
  uint32_t* counter = nullptr;  // [0]: GEMM tile counter; AG: then [P-1][m tiles] push counters;
                                // RS: [1] done counter of the peer block's tiles (copy engine)
  uint32_t seq = 0;
  uint32_t rs_ce_rounds = 0;  // RS copy-engine launches so far (done counter target / tiles)
  uint32_t tiles_taken = 0;  // GEMM tile counter value after all launches so far (tiles + grid each)
};

struct Channel {
  std::string key;
  int nranks = 0;
  Mailbox* mbox = nullptr;  // host-mapped, portable
  uint64_t timeout_ns = 0;  // of the latest call (for messages)
  RankState ranks[kMaxRanks];
  std::mutex mu;
};

struct DeviceState {  // per device: side stream for the AG pushes
  cudaStream_t side = nullptr;
  cudaEvent_t start = nullptr, done = nullptr;
  int sms = 0;
};

std::mutex g_mu;
std::unordered_map<std::string, std::unique_ptr<Channel>> g_channels;
std::unordered_map<int, std::unique_ptr<DeviceState>> g_devices;

// Diagnostics (benchmarks/overlap_diag.py): no_comm runs the fused GEMM without
// any waits or remote stores (results invalid); profile times every fused GEMM
// and push kernel with CUDA events (read by ProfileResults()).
std::atomic<bool> g_no_comm{false}, g_profile{false};
struct Timed {
  std::string what;
  cudaEvent_t a = nullptr, b = nullptr;
  float host_ms = -1.f;  // a host-side duration instead of events
};
std::vector<Timed> g_timed;  // under g_mu
struct Timeline {  // one profiled launch's device timeline (protocol.h kTlWords)
  std::string key;
  int ordinal = 0, kind = 0, rank = 0, nranks = 1, per_block = 0, tiles = 0, grid = 1, side = 0;
  uint64_t* dev = nullptr;
  cudaEvent_t done = nullptr;
};
std::vector<Timeline> g_tl;  // under g_mu

uint64_t* TimelineAlloc(cudaStream_t s, size_t words) {  // stream-ordered, profile only
  if (!g_profile.load()) return nullptr;
  void* p = nullptr;
  OV_CUDA(cudaMallocAsync(&p, words * sizeof(uint64_t), s));
  OV_CUDA(cudaMemsetAsync(p, 0, words * sizeof(uint64_t), s));
  return static_cast<uint64_t*>(p);
}

void KeepTimeline(Timeline t, cudaStream_t s) {  // after everything that writes it on `s`
  if (t.dev == nullptr) return;
  OV_CUDA(cudaEventCreateWithFlags(&t.done, cudaEventDisableTiming));
  OV_CUDA(cudaEventRecord(t.done, s));
  std::lock_guard<std::mutex> lock(g_mu);
  g_tl.push_back(std::move(t));
}

cudaEvent_t Mark(cudaStream_t s) {
  cudaEvent_t e = nullptr;
  if (!g_profile.load()) return e;
  OV_CUDA(cudaEventCreate(&e));
  OV_CUDA(cudaEventRecord(e, s));
  return e;
}

void Keep(std::string_view key, const char* what, cudaEvent_t a, cudaEvent_t b) {  // profile only
  if (a == nullptr || b == nullptr) return;
  std::lock_guard<std::mutex> lock(g_mu);
  g_timed.push_back({std::string(key) + what, a, b});
}

class HostTimer {  // "<key>|host": wall time of one handler call (profile only)
 public:
  explicit HostTimer(std::string_view key) : key_(key), t0_(std::chrono::steady_clock::now()) {}  // no copy: hot path
  ~HostTimer() {
    if (!g_profile.load()) return;
    const float ms = std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - t0_).count();
    std::lock_guard<std::mutex> lock(g_mu);
    g_timed.push_back({std::string(key_) + "|host", nullptr, nullptr, ms});
  }

 private:
  std::string_view key_;  // the custom call's attribute, alive for the whole call
  std::chrono::steady_clock::time_point t0_;
};

class DeviceGuard {  // makes `ordinal` current, restores the previous device
 public:
  explicit DeviceGuard(int ordinal) {
    OV_CUDA(cudaGetDevice(&prev_));
    if (prev_ != ordinal) OV_CUDA(cudaSetDevice(ordinal));
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }

 private:
  int prev_ = 0;
};

DeviceState& Device(int ordinal) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& d = g_devices[ordinal];
  if (!d) {
    d = std::make_unique<DeviceState>();
    OV_CUDA(cudaStreamCreateWithFlags(&d->side, cudaStreamNonBlocking));
    OV_CUDA(cudaEventCreateWithFlags(&d->start, cudaEventDisableTiming));
    OV_CUDA(cudaEventCreateWithFlags(&d->done, cudaEventDisableTiming));
    OV_CUDA(cudaDeviceGetAttribute(&d->sms, cudaDevAttrMultiProcessorCount, ordinal));
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
  for (int d : devs) {
    if (d == rs.ordinal) continue;
    int can = 0;
    OV_CUDA(cudaDeviceCanAccessPeer(&can, rs.ordinal, d));
    DFCCL_CHECK(can, "dfccl overlap '" << c.key << "': GPU " << rs.ordinal << " cannot access GPU " << d);
    cudaError_t e = cudaDeviceEnablePeerAccess(d, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();  // clear the sticky-free error
    else OV_CUDA(e);
  }
  OV_CUDA(cudaMalloc(&rs.buf, buf_bytes > 0 ? buf_bytes : 16));
  OV_CUDA(cudaMalloc(reinterpret_cast<void**>(&rs.flags), flag_words * sizeof(uint32_t)));
  OV_CUDA(cudaMalloc(reinterpret_cast<void**>(&rs.counter), counter_words * sizeof(uint32_t)));
  OV_CUDA(cudaMemsetAsync(rs.flags, 0, flag_words * sizeof(uint32_t), stream));
  OV_CUDA(cudaMemsetAsync(rs.counter, 0, counter_words * sizeof(uint32_t), stream));
  // Published before this rank's first ready write is enqueued (peers read the
  // pointers only after seeing ready >= 1).
  c.mbox->recv[rank] = reinterpret_cast<uint64_t>(rs.buf);
  c.mbox->flags[rank] = reinterpret_cast<uint64_t>(rs.flags);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  rs.init = true;
}

std::string Describe(const Channel& c, uint32_t code) {
  static const char* what[] = {"?", "the ready flag (receive buffer free)", "partial tiles", "gathered rows",
                               "the ready flag (gather buffer free)", "its own partial tiles (local)"};
  const uint32_t w = code >> 24, waiter = (code >> 16) & 0xff, peer = (code >> 8) & 0xff;
  std::ostringstream os;
  os << "dfccl overlap '" << c.key << "': rank " << waiter << " (GPU " << c.ranks[waiter % kMaxRanks].ordinal
     << ") timed out after " << c.timeout_ns / 1000000 << " ms waiting for " << what[w <= 5 ? w : 0]
     << " of rank " << peer << " (GPU " << c.ranks[peer % kMaxRanks].ordinal
     << "); results of this op are invalid from then on";
  return os.str();
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

using LaunchFn = cudaError_t (*)(const GemmLaunch&, cudaStream_t);

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
  uint64_t peer_buf[kMaxRanks], peer_flags[kMaxRanks];  // 0 where that rank has not initialized yet
};

Prologue Begin(cudaStream_t stream, const std::string& key, const Group& g, size_t buf_bytes, size_t flag_words,
               size_t counter_words, uint64_t timeout_ns) {
  Channel& c = GetChannel(key, static_cast<int>(g.devs.size()));
  std::lock_guard<std::mutex> lock(c.mu);
  c.timeout_ns = timeout_ns;
  if (!c.ranks[g.rank].init) InitRank(c, g.rank, g.devs, buf_bytes, flag_words, counter_words, stream);
  const uint32_t err = *reinterpret_cast<volatile uint32_t*>(&c.mbox->error);
  DFCCL_CHECK(err == 0, Describe(c, err));
  const uint32_t seq = ++c.ranks[g.rank].seq;
  // Our previous instance is complete in stream order: peers may write again.
  dfccl::gpu::StreamOps::Write32(stream, &c.mbox->ready[g.rank], seq);
  Prologue p{&c, &c.ranks[g.rank], seq, {}, {}};
  for (int r = 0; r < c.nranks; ++r) {  // written by each rank's InitRank under c.mu
    p.peer_buf[r] = c.ranks[r].init ? c.mbox->recv[r] : 0;
    p.peer_flags[r] = c.ranks[r].init ? c.mbox->flags[r] : 0;
  }
  return p;
}

// Copy-engine transfer on the side stream (protocol.h): wait for the peer's
// ready (and *counter >= target), copy `bytes` from src to the peer's buffer at
// dst_off, then raise the peer's flag words [flag_off, flag_off + count).
void SideCopy(cudaStream_t side, const Prologue& pro, int rank, int d, const void* src, size_t dst_off, size_t bytes,
              size_t flag_off, int count, const uint32_t* counter, uint32_t target, uint64_t timeout_ns,
              uint64_t* tl) {
  SideSync ss;
  ss.mbox = pro.c->mbox; ss.rank = rank; ss.peer = d; ss.seq = pro.seq; ss.timeout_ns = timeout_ns;
  ss.flags = reinterpret_cast<uint32_t*>(pro.peer_flags[d]) + flag_off;
  ss.count = count; ss.counter = counter; ss.target = target; ss.tl = tl;
  OV_CUDA(LaunchReadyWait(ss, side));
  OV_CUDA(cudaMemcpyAsync(reinterpret_cast<char*>(pro.peer_buf[d]) + dst_off, src, bytes, cudaMemcpyDeviceToDevice,
                          side));
  OV_CUDA(LaunchSignal(ss, side));
}

ffi::Error AgImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> xg, std::string_view key,
                  ffi::Span<const int64_t> devices, int32_t group_size, int64_t timeout_ns, int32_t mode) {
  try {
    HostTimer host_timer(key);
    DeviceGuard guard(ordinal);
    const Group g = FindGroup(devices, group_size, ordinal);
    const int P = static_cast<int>(g.devs.size());
    const bool no_comm = g_no_comm.load();
    auto xd = x.dimensions(), wd = w.dimensions();
    DFCCL_CHECK(xd.size() == 2 && wd.size() == 2 && xd[1] == wd[0] && x.element_type() == w.element_type(),
                "dfccl overlap AG '" << key << "': bad operand shapes");
    const int m = static_cast<int>(xd[0]), K = static_cast<int>(xd[1]), n = static_cast<int>(wd[1]);
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
    const bool push = P > 1 && !no_comm;
    // Copy engine once every peer's buffers are known here (from their first
    // call on); else the SM push kernel, which finds them in the mailbox.
    bool ce = (mode & kModeCopyEngine) != 0;
    for (int r = 0; r < P; ++r) ce = ce && pro.peer_buf[r] != 0 && pro.peer_flags[r] != 0;
    const int push_ctas = ce ? 0 : std::min<int>(16, (P - 1) * mtiles * 4);  // 4: pieces per chunk (push.cu)
    pl.grid = push_ctas;
    const int tiles = P * int(mtiles) * ((n + kTileN - 1) / kTileN);
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
                   tl ? tl + size_t(tiles) * kTlWords + size_t(j - 1) * kTlSide : nullptr);
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
    // Copy engine: one SM stays free for the side stream's wait / signal kernels
    // (the persistent GEMM's CTAs wait for flags those kernels raise).
    gl.grid = std::max(1, std::min(dev.sms - (push ? std::max(push_ctas, 1) : 0), tiles));
    gl.tile_base = pro.rs->tiles_taken;
    pro.rs->tiles_taken += uint32_t(tiles + gl.grid);
    cudaEvent_t g0 = Mark(stream);
    OV_CUDA(launch(gl, stream));
    Keep(key, no_comm ? "|gemm_nocomm" : "|gemm", g0, Mark(stream));
    if (push) OV_CUDA(cudaStreamWaitEvent(stream, dev.done, 0));
    if (tl) KeepTimeline({std::string(key), ordinal, kAllGatherGemm, g.rank, P, tiles / P, tiles, gl.grid,
                  push && ce ? P - 1 : 0, tl, nullptr}, stream);
    if (xg->element_count() > 0) {  // all_gather(x) for the VJP: own rows + received slots
      char* dst = static_cast<char*>(xg->untyped_data());
      const size_t blk = size_t(m) * K * esz;
      for (int b = 0; b < P; ++b)
        OV_CUDA(cudaMemcpyAsync(dst + b * blk, gl.a[b], blk, cudaMemcpyDeviceToDevice, stream));
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
}

ffi::Error RsImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Result<ffi::AnyBuffer> out, std::string_view key, ffi::Span<const int64_t> devices,
                  int32_t group_size, int64_t timeout_ns, int32_t mode) {
  try {
    HostTimer host_timer(key);
    DeviceGuard guard(ordinal);
    const Group g = FindGroup(devices, group_size, ordinal);
    const int P = static_cast<int>(g.devs.size());
    auto xd = x.dimensions(), wd = w.dimensions();
    DFCCL_CHECK(xd.size() == 2 && wd.size() == 2 && xd[1] == wd[0] && x.element_type() == w.element_type(),
                "dfccl overlap RS '" << key << "': bad operand shapes");
    const int M = static_cast<int>(xd[0]), k = static_cast<int>(xd[1]), N = static_cast<int>(wd[1]);
    DFCCL_CHECK(M % P == 0 && k % 8 == 0 && N % 8 == 0,
                "dfccl overlap RS '" << key << "': M must divide by the ranks, k and N be multiples of 8");
    const int mb = M / P;
    const LaunchFn launch = Dispatch(x.element_type());
    const size_t esz = 2;
    const int per_block = ((mb + kTileM - 1) / kTileM) * ((N + kTileN - 1) / kTileN);
    DeviceState& dev = Device(ordinal);
    auto pro = Begin(stream, ChannelKey(key, g, x.element_type()), g, size_t(P) * mb * N * esz,
                     size_t(P) * per_block, 1 + P, uint64_t(timeout_ns));
    const bool no_comm = g_no_comm.load();
    // Copy engine (2 ranks, every rank's buffers known): the peer block goes to
    // our own (unused) recv slot, the side stream moves it once complete.
    bool ce = (mode & kModeRsCopyEngine) != 0 && P == 2 && !no_comm;
    for (int r = 0; r < P; ++r) ce = ce && pro.peer_buf[r] != 0 && pro.peer_flags[r] != 0;
    GemmLaunch gl;
    gl.kind = kGemmReduceScatter; gl.rank = g.rank; gl.nranks = P; gl.mb = mb; gl.n = N; gl.k = k;
    for (int b = 0; b < P; ++b) gl.a[b] = static_cast<const char*>(x.untyped_data()) + size_t(b) * mb * k * esz;
    gl.w = w.untyped_data(); gl.out = out->untyped_data(); gl.local_recv = pro.rs->buf;
    gl.local_flags = pro.rs->flags; gl.tile_counter = pro.rs->counter; gl.mbox = pro.c->mbox;
    gl.seq = pro.seq; gl.timeout_ns = uint64_t(timeout_ns); gl.no_comm = no_comm;
    gl.thread_fences = (mode & kModeCtaFence) ? 0 : 1;
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
               gl.tl ? gl.tl + size_t(P) * per_block * kTlWords : nullptr);
      Keep(key, "|copy", p0, Mark(dev.side));
      OV_CUDA(cudaEventRecord(dev.done, dev.side));
    }
    // Copy engine: one SM stays free for the side stream's wait / signal kernels.
    gl.grid = std::max(1, std::min(dev.sms - (ce ? 1 : 0), P * per_block));
    gl.tile_base = pro.rs->tiles_taken;
    pro.rs->tiles_taken += uint32_t(P * per_block + gl.grid);
    cudaEvent_t g0 = Mark(stream);
    OV_CUDA(launch(gl, stream));
    Keep(key, gl.no_comm ? "|gemm_nocomm" : "|gemm", g0, Mark(stream));
    if (ce) OV_CUDA(cudaStreamWaitEvent(stream, dev.done, 0));
    if (gl.tl) KeepTimeline({std::string(key), ordinal, kGemmReduceScatter, g.rank, P, per_block, P * per_block, gl.grid,
                  ce ? 1 : 0, gl.tl, nullptr}, stream);
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
}

// One profiled launch's timeline -> (key|tl_<what>, ms) summaries:
//   span            first tile start .. last tile done
//   start_r<rank>   first tile start (globaltimer mod 1 s; ranks' skew)
//   mma_avg         mean MMA time per tile (includes waiting for TMA data)
//   cwait_per_cta   consumer time blocked on the peer (RS ready / partials) / CTAs
//   pwait_per_cta   AG producer time blocked on row flags / CTAs (overlaps MMA)
//   wait_max        longest single wait
//   epi_own_avg, epi_peer_avg  epilogue time of own / peer-block tiles (RS peer:
//                   remote stores + fence + flag)
//   own_done        AG: when the own block's last tile finished (from span start)
//   peer_done       RS: when the last partial for a peer was flagged
//   first_rows      AG: when the first peer chunk's flag was seen
//   ready_wait, ready_at, copy, signal_at   AG copy engine, first peer: time the
//                   side stream waited for its ready, when it saw it, copy time,
//                   when the flags were raised (from span start)
void Summarize(const Timeline& t, const std::vector<uint64_t>& h, std::vector<std::pair<std::string, float>>& out) {
  uint64_t t0 = ~0ull, t1 = 0, own_end = 0, peer_end = 0, first_rows = ~0ull, wait_max = 0;
  double mma = 0, cwait = 0, pwait = 0, epi_own = 0, epi_peer = 0;
  int n = 0, n_own = 0, n_peer = 0;
  for (int i = 0; i < t.tiles; ++i) {
    const uint64_t* r = &h[size_t(i) * kTlWords];
    if (r[0] == 0 || r[3] == 0) continue;
    const int s = i / std::max(1, t.per_block);
    const bool own = t.kind == kAllGatherGemm ? s == 0 : s == t.nranks - 1;
    ++n;
    t0 = std::min(t0, r[0]);
    t1 = std::max(t1, r[3]);
    mma += double(r[1] - r[0]);
    cwait += double(r[2] - r[1]);
    wait_max = std::max(wait_max, r[2] - r[1]);
    if (r[4] != 0 && r[5] >= r[4]) {
      pwait += double(r[5] - r[4]);
      wait_max = std::max(wait_max, r[5] - r[4]);
      first_rows = std::min(first_rows, r[5]);
    }
    if (own) ++n_own, epi_own += double(r[3] - r[2]), own_end = std::max(own_end, r[3]);
    else ++n_peer, epi_peer += double(r[3] - r[2]), peer_end = std::max(peer_end, r[3]);
  }
  if (n == 0) return;
  const std::string k = t.key + "|tl_";
  auto ms = [](double ns) { return float(ns / 1e6); };
  out.emplace_back(k + "span", ms(double(t1 - t0)));
  // Start of the first tile, globaltimer mod 1 s, per rank: the diagnostic pairs
  // the ranks' calls to estimate their skew (globaltimers of one host's GPUs
  // follow the host clock; float keeps ~0.1 us here).
  out.emplace_back(k + "start_r" + std::to_string(t.rank), ms(double(t0 % 1000000000ull)));
  out.emplace_back(k + "mma_avg", ms(mma / n));
  out.emplace_back(k + "cwait_per_cta", ms(cwait / t.grid));
  out.emplace_back(k + "wait_max", ms(double(wait_max)));
  if (n_own) out.emplace_back(k + "epi_own_avg", ms(epi_own / n_own));
  if (n_peer) out.emplace_back(k + "epi_peer_avg", ms(epi_peer / n_peer));
  if (t.kind == kAllGatherGemm) {
    out.emplace_back(k + "pwait_per_cta", ms(pwait / t.grid));
    if (n_own) out.emplace_back(k + "own_done", ms(double(own_end - t0)));
    if (first_rows != ~0ull) out.emplace_back(k + "first_rows", ms(double(first_rows) - double(t0)));
  } else if (n_peer) {
    out.emplace_back(k + "peer_done", ms(double(peer_end - t0)));
  }
  if (t.side > 0) {
    const uint64_t* r = &h[size_t(t.tiles) * kTlWords];
    if (r[0] && r[1] && r[2]) {
      out.emplace_back(k + "ready_wait", ms(double(r[1] - r[0])));
      out.emplace_back(k + "ready_at", ms(double(r[1]) - double(t0)));
      out.emplace_back(k + "copy", ms(double(r[2] - r[1])));
      out.emplace_back(k + "signal_at", ms(double(r[2]) - double(t0)));
    }
  }
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

void SetDiag(bool no_comm, bool profile) {
  g_no_comm = no_comm;
  g_profile = profile;
}

std::vector<std::pair<std::string, float>> ProfileResults() {
  std::vector<Timed> timed;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    timed.swap(g_timed);
  }
  std::vector<std::pair<std::string, float>> out;
  for (auto& t : timed) {
    float ms = t.host_ms;
    if (t.a == nullptr) {
      out.emplace_back(t.what, ms);
      continue;
    }
    if (cudaEventSynchronize(t.b) == cudaSuccess) cudaEventElapsedTime(&ms, t.a, t.b);
    cudaEventDestroy(t.a);
    cudaEventDestroy(t.b);
    out.emplace_back(t.what, ms);
  }
  std::vector<Timeline> tls;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    tls.swap(g_tl);
  }
  for (auto& t : tls) {
    DeviceGuard guard(t.ordinal);
    const size_t words = size_t(t.tiles) * kTlWords + size_t(kMaxRanks) * kTlSide;
    std::vector<uint64_t> h(words, 0);
    if (cudaEventSynchronize(t.done) == cudaSuccess &&
        cudaMemcpy(h.data(), t.dev, words * sizeof(uint64_t), cudaMemcpyDeviceToHost) == cudaSuccess)
      Summarize(t, h, out);
    cudaEventDestroy(t.done);
    cudaFreeAsync(t.dev, nullptr);
  }
  cudaGetLastError();  // nothing sticky from the best-effort reads above
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
