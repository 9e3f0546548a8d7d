// Diagnostics of the fused overlap ops (profile.h): event timings, handler
// wall time, per-launch device timelines, and ProfileResults(), which returns
// them as (name, ms) pairs:
//   <key>|gemm, |gemm_nocomm, |push, |copy   CUDA-event time of the fused GEMM
//                                            kernel / the side-stream transfer
//   <key>|host                               wall time of one handler call
//   <key>|tl_<what>                          per-launch timeline summaries (Summarize)
//   <key>|tlraw|<json>                       one launch's whole timeline (RawJson);
//                                            the value is its span in ms
#include "overlap/profile.h"

#include <algorithm>
#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

#include "overlap/protocol.h"

namespace dfccl::overlap {
namespace prof {

std::atomic<bool> g_no_comm{false}, g_profile{false};

namespace {

struct Timed {
  std::string what;
  cudaEvent_t a = nullptr, b = nullptr;
  float host_ms = -1.f;  // a host-side duration instead of events
};

std::mutex g_mu;             // guards the two lists
std::vector<Timed> g_timed;
std::vector<Timeline> g_tl;

size_t Words(const Timeline& t) { return size_t(t.tiles) * kTlWords + size_t(kMaxRanks) * kTlSide; }

// One launch's timeline -> (key|tl_<what>, ms) summaries:
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
//   ready_wait, ready_at, copy, signal_at   copy engine, first peer: time the
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

// One launch's whole timeline as JSON (jax_dfccl._src.overlap_gpu parses it):
// times in ns relative to base_ns (the earliest recorded globaltimer value of
// the launch, absolute, so that ranks' launches can be put side by side), -1
// where nothing was recorded.  tile rows: [tile index, SM, got, mma_done,
// waits_done, done, row_wait_start, row_wait_end]; side rows (copy engine, per
// peer j): [j, wait_start, ready_seen, signal]; kernel: [start, announced].
std::string RawJson(const Timeline& t, const std::vector<uint64_t>& h, float* span_ms) {
  const uint64_t* launch = &h[size_t(t.tiles) * kTlWords + size_t(kTlLaunch) * kTlSide];
  uint64_t base = launch[0] != 0 ? launch[0] : ~0ull, end = 0;
  for (int i = 0; i < t.tiles; ++i) {
    const uint64_t* r = &h[size_t(i) * kTlWords];
    if (r[0] != 0) base = std::min(base, r[0]);
    if (r[3] != 0) end = std::max(end, r[3]);
  }
  if (base == ~0ull) return {};
  *span_ms = end > base ? float(double(end - base) / 1e6) : 0.f;
  auto rel = [&](uint64_t v) { return v == 0 ? int64_t(-1) : int64_t(v) - int64_t(base); };
  std::ostringstream os;
  os << "{\"key\":\"" << t.key << "\",\"ordinal\":" << t.ordinal << ",\"rank\":" << t.rank << ",\"nranks\":"
     << t.nranks << ",\"kind\":\"" << (t.kind == kAllGatherGemm ? "ag" : "rs") << "\",\"per_block\":" << t.per_block
     << ",\"tiles\":" << t.tiles << ",\"grid\":" << t.grid << ",\"side\":" << t.side << ",\"host_ns\":" << t.host_ns
     << ",\"base_ns\":" << base << ",\"kernel\":[" << rel(launch[0]) << "," << rel(launch[1]) << "],\"tile\":[";
  bool first = true;
  for (int i = 0; i < t.tiles; ++i) {
    const uint64_t* r = &h[size_t(i) * kTlWords];
    if (r[0] == 0) continue;
    os << (first ? "" : ",") << "[" << i << "," << int64_t(r[3] != 0 ? r[6] : -1);
    for (int w : {0, 1, 2, 3, 4, 5}) os << "," << rel(r[w]);
    os << "]";
    first = false;
  }
  os << "],\"side_rec\":[";
  first = true;
  for (int j = 0; j < t.side && j < kTlLaunch; ++j) {
    const uint64_t* r = &h[size_t(t.tiles) * kTlWords + size_t(j) * kTlSide];
    os << (first ? "" : ",") << "[" << j + 1 << "," << rel(r[0]) << "," << rel(r[1]) << "," << rel(r[2]) << "]";
    first = false;
  }
  os << "]}";
  return os.str();
}

}  // namespace

int64_t HostNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

uint64_t* TimelineAlloc(cudaStream_t s, size_t words) {
  if (!Profiling()) return nullptr;
  void* p = nullptr;
  OV_CUDA(cudaMallocAsync(&p, words * sizeof(uint64_t), s));
  OV_CUDA(cudaMemsetAsync(p, 0, words * sizeof(uint64_t), s));
  return static_cast<uint64_t*>(p);
}

void KeepTimeline(Timeline t, cudaStream_t s) {
  if (t.dev == nullptr) return;
  OV_CUDA(cudaEventCreateWithFlags(&t.done, cudaEventDisableTiming));
  OV_CUDA(cudaEventRecord(t.done, s));
  std::lock_guard<std::mutex> lock(g_mu);
  g_tl.push_back(std::move(t));
}

cudaEvent_t Mark(cudaStream_t s) {
  cudaEvent_t e = nullptr;
  if (!Profiling()) return e;
  OV_CUDA(cudaEventCreate(&e));
  OV_CUDA(cudaEventRecord(e, s));
  return e;
}

void Keep(std::string_view key, const char* what, cudaEvent_t a, cudaEvent_t b) {
  if (a == nullptr || b == nullptr) return;
  std::lock_guard<std::mutex> lock(g_mu);
  g_timed.push_back({std::string(key) + what, a, b});
}

void KeepHost(std::string_view key, float ms) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_timed.push_back({std::string(key) + "|host", nullptr, nullptr, ms});
}

}  // namespace prof

void SetDiag(bool no_comm, bool profile) {
  prof::g_no_comm = no_comm;
  prof::g_profile = profile;
}

std::vector<std::pair<std::string, float>> ProfileResults() {
  using namespace prof;
  std::vector<Timed> timed;
  std::vector<Timeline> tls;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    timed.swap(g_timed);
    tls.swap(g_tl);
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
  for (auto& t : tls) {
    DeviceGuard guard(t.ordinal);
    const size_t words = Words(t);
    std::vector<uint64_t> h(words, 0);
    if (cudaEventSynchronize(t.done) == cudaSuccess &&
        cudaMemcpy(h.data(), t.dev, words * sizeof(uint64_t), cudaMemcpyDeviceToHost) == cudaSuccess) {
      Summarize(t, h, out);
      float span = 0.f;
      std::string raw = RawJson(t, h, &span);
      if (!raw.empty()) out.emplace_back(t.key + "|tlraw|" + raw, span);
    }
    cudaEventDestroy(t.done);
    cudaFreeAsync(t.dev, nullptr);
  }
  cudaGetLastError();  // nothing sticky from the best-effort reads above
  return out;
}

}  // namespace dfccl::overlap
