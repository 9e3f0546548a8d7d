// NVSHMEM's set-up and the transport check (transport/nvshmem_engine.h).
//
// The check runs protocol C (transport/announce.cuh) on every PE at once, one
// thread per PE as the daemon's control warp would, over each transport in its
// own symmetric region: blocks of instances started in rank-specific orders on
// fewer receive slots than a block has instances (the reserve is granted), each
// a sum of every rank's message checked against the reference computed on the
// device; every k-th instance with another signature on the last rank, which
// every rank must fail naming it; the cap refused at once; then a put-with-signal
// ping-pong between PEs 0 and 1.  Every wait is bounded (spec.timeout_s).
#include "transport/nvshmem_engine.h"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>

#include "dfccl/check.h"
#include "transport/announce.cuh"
#include "transport/nvshmem.cuh"

namespace dfccl::nvshm {
namespace {

using NvshmemTransport = gpu::DelayedTransport<gpu::NvshmemTransport>;
using StoreTransport = gpu::DelayedTransport<gpu::StoreTransport>;
namespace ann = gpu::ann;

#define NV_CUDA(call) DFCCL_CHECK_CUDA(call, "dfccl nvshmem")

constexpr int kTasks = 8;
constexpr uint32_t kSlotBytes = 256;
constexpr int kMaxRoundTrips = 1 << 16;

struct KSpec {
  int blocks, per_block, msg_bytes, mismatch_every, pingpong;
  uint64_t seed, timeout_ns;
  uint64_t extra;  // region offset of the check's own words (after the protocol's layout)
};
// Offsets inside the extra area.
constexpr uint64_t kBar = 0, kPpSig = 64, kPpData = 128, kScratch = 192, kSrc = 256;

struct KResult {
  int64_t ok, failed_as_expected, wrong;
  int32_t cap_refused, done;
  uint64_t err_key, err_seq, err_ranks, t_ns;
  uint32_t err_status, err_what;  // err_what: 1 wrong sum, 2 failed otherwise, 3 completed a mismatch,
                                  // 4 start refused, 5 not done in time, 6 barrier timeout, 7 not empty
  double rt_ns[kMaxRoundTrips];
};

__device__ uint64_t Mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ uint64_t Val(uint64_t key, int r, int j) { return Mix(key * 1000003ull + static_cast<uint64_t>(r) * 17 + j); }

template <class T>
struct Checker {
  T& t;
  ann::Announcer<T>& a;
  const KSpec& s;
  KResult* r;
  int me, n;

  // Waits (device/wait.cuh, the signal policy) until ready(), progressing the
  // protocol meanwhile (peers may need this rank's credits, releases, verdicts).
  template <class Ready>
  __device__ bool Await(Ready ready) {
    return gpu::SpinWait<gpu::SignalWait>([&] { return ready() || (a.Progress(), ready()); }, s.timeout_ns) ==
           gpu::WaitEnd::kReady;
  }
  __device__ void Wrong(uint32_t what, uint64_t key, uint32_t status, uint64_t ranks) {
    if (r->wrong++ == 0) {
      r->err_what = what;
      r->err_key = key;
      r->err_status = status;
      r->err_ranks = ranks;
    }
  }
  // Every rank at barrier b (b = 0, 1, ...), progressing meanwhile.
  __device__ bool Barrier(int b) {
    for (int q = 0; q < n; ++q)
      if (q != me) t.Put(q, s.extra + kScratch, t.Local(s.extra + kScratch), 8, s.extra + kBar, 1);
    const uint64_t want = static_cast<uint64_t>(b + 1) * (n - 1);
    if (Await([&] { return t.Signal(s.extra + kBar) >= want; })) return true;
    return Wrong(6, b, 0, 0), false;
  }
  __device__ void Run() {
    const uint64_t tstart = gpu::GlobalTimer();
    int h[kTasks], order[kTasks];
    for (int b = 0; b < s.blocks && r->wrong == 0; ++b) {
      const int k = s.per_block;
      for (int i = 0; i < k; ++i) order[i] = i;
      uint64_t z = Mix(s.seed * 7919 + static_cast<uint64_t>(b) * 131 + me);
      for (int i = k - 1; i > 0; --i) {  // this rank's order of the block
        z = Mix(z);
        const int j = static_cast<int>(z % static_cast<uint64_t>(i + 1));
        const int x = order[i]; order[i] = order[j]; order[j] = x;
      }
      for (int o = 0; o < k; ++o) {
        const int i = order[o];
        const uint64_t key = static_cast<uint64_t>(b) * k + i + 1;
        uint64_t* src = reinterpret_cast<uint64_t*>(t.Local(s.extra + kSrc + static_cast<uint64_t>(i) * s.msg_bytes));
        for (int j = 0; j < s.msg_bytes / 8; ++j) src[j] = Val(key, me, j);
        const bool differ = s.mismatch_every > 0 && n > 1 && key % s.mismatch_every == 0 && me == n - 1;
        uint32_t st = 0;
        h[i] = a.Start(key, 0, Mix(key ^ s.msg_bytes) + (differ ? 1 + me : 0), src, s.msg_bytes, &st);
        if (h[i] < 0) return Wrong(4, key, st, 0);
      }
      if (b == 0 && k == kTasks) {  // the cap: the (I+1)-th start is refused at once
        uint32_t st = 0;
        const uint64_t t0 = gpu::GlobalTimer();
        const int x = a.Start(0xCA9, 0, 1, t.Local(s.extra + kScratch), 8, &st);
        r->cap_refused = x == -1 && st == gpu::PackStatus(gpu::kStatusNoEntry, me, me) &&
                         gpu::GlobalTimer() - t0 < 250000000ull;
      }
      int left = k;
      const uint64_t t0 = gpu::GlobalTimer();
      while (left > 0) {
        a.Progress();
        for (int i = 0; i < k; ++i) {
          if (h[i] < 0) continue;
          const ann::Task& task = a.TaskOf(h[i]);
          if (task.state == ann::kRunning) continue;
          const uint64_t key = static_cast<uint64_t>(b) * k + i + 1;
          const bool mismatch = s.mismatch_every > 0 && n > 1 && key % s.mismatch_every == 0;
          const uint64_t differ = mismatch ? 1ull << (n - 1) : 0;
          if (task.state == ann::kFailed) {
            if (mismatch && task.status == gpu::PackStatus(gpu::kStatusMismatch, 0, n - 1) && task.ranks == differ)
              r->failed_as_expected++;
            else
              Wrong(2, key, task.status, task.ranks);
          } else if (mismatch) {
            Wrong(3, key, 0, differ);
          } else {
            bool same = true;
            for (int j = 0; j < s.msg_bytes / 8 && same; ++j) {
              uint64_t sum = 0, want = 0;
              for (int q = 0; q < n; ++q) {
                sum += gpu::LdVol(reinterpret_cast<const uint64_t*>(a.Received(h[i], q)) + j);
                want += Val(key, q, j);
              }
              same = sum == want;
            }
            if (same) r->ok++;
            else Wrong(1, key, 0, 0);
          }
          a.Finish(h[i]);
          h[i] = -1;
          --left;
        }
        if (left > 0 && gpu::GlobalTimer() - t0 > 2 * s.timeout_ns) {
          for (int i = 0; i < k; ++i)
            if (h[i] >= 0) Wrong(5, static_cast<uint64_t>(b) * k + i + 1, 0, 0);
          return;
        }
      }
    }
    r->t_ns = gpu::GlobalTimer() - tstart;
  }
  // PE 0 <-> PE 1: 8 bytes with a signal, answered the same way.
  __device__ void PingPong() {
    if (me > 1 || n < 2) return;
    const int peer = 1 - me;
    const char* src = t.Local(s.extra + kScratch);
    for (int k = 1; k <= s.pingpong; ++k) {
      const uint64_t t0 = gpu::GlobalTimer();
      if (me == 0) t.Put(peer, s.extra + kPpData, src, 8, s.extra + kPpSig, 1);
      if (gpu::WaitSignal(t, s.extra + kPpSig, static_cast<uint64_t>(k), s.timeout_ns) != gpu::WaitEnd::kReady)
        return Wrong(5, 0xFFFF, 0, 0);
      if (me == 1) t.Put(peer, s.extra + kPpData, src, 8, s.extra + kPpSig, 1);
      else if (k - 1 < kMaxRoundTrips) r->rt_ns[k - 1] = static_cast<double>(gpu::GlobalTimer() - t0);
    }
  }
};

template <class T>
__global__ void CheckKernel(T t, ann::Layout l, ann::Config c, KSpec s, KResult* r) {
  ann::Announcer<T> a(t, l, c);
  a.Init();
  Checker<T> ck{t, a, s, r, t.Rank(), t.Ranks()};
  // Every region initialised before the first put of the protocol (barrier 0).
  if (!ck.Barrier(0)) return;
  ck.Run();
  if (!ck.Barrier(1)) return;  // (peers may still need this rank's credits and releases)
  if (!ck.Await([&] { return a.Empty(); })) ck.Wrong(7, 0, 0, 0);  // table, tasks, slots, mailboxes empty
  if (!ck.Barrier(2)) return;
  ck.PingPong();
  t.Flush(0);
  r->done = 1;
}

std::string Version(int major, int minor, int patch) {
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

std::string Describe(const KResult& r) {
  static const char* what[] = {"", "a sum differs from the reference", "failed otherwise than expected",
                               "completed an instance that must fail", "a start was refused",
                               "not done in time", "a barrier timed out", "table, slots or mailboxes not empty"};
  char status[256] = "";
  if (r.err_status) ann::Describe(status, sizeof status, r.err_key, 0, r.err_status, r.err_ranks);
  std::ostringstream os;
  os << what[r.err_what < 8 ? r.err_what : 0] << " (key " << r.err_key << (r.err_status ? "; " : "") << status << ")";
  return os.str();
}

bool g_init = false;

}  // namespace

std::string BuiltVersion() {
  return Version(NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION);
}

std::string LoadedVersion() {
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  return Version(major, minor, patch);
}

std::string UniqueId() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  DFCCL_CHECK_CODE(nvshmemx_get_uniqueid(&id) == 0, ErrorCode::kInternal, "dfccl nvshmem: nvshmemx_get_uniqueid failed");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

std::string Init(const std::string& uid, int rank, int nranks, int device) {
  DFCCL_CHECK(!g_init, "dfccl nvshmem: already initialised");
  if (device >= 0) NV_CUDA(cudaSetDevice(device));
  DFCCL_CHECK(uid.size() == sizeof(nvshmemx_uniqueid_t),
              "dfccl nvshmem: a unique id has " << sizeof(nvshmemx_uniqueid_t) << " bytes, got " << uid.size());
  DFCCL_CHECK(rank >= 0 && rank < nranks, "dfccl nvshmem: rank " << rank << " of " << nranks);
  DFCCL_CHECK_CODE(LoadedVersion() == BuiltVersion(), ErrorCode::kFailedPrecondition,
                   "dfccl nvshmem: built with NVSHMEM " << BuiltVersion() << ", loaded " << LoadedVersion()
                   << " (install nvidia-nvshmem-cu13==" << BuiltVersion() << ")");
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  DFCCL_CHECK_CODE(nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr) == 0, ErrorCode::kInternal,
                   "dfccl nvshmem: nvshmemx_set_attr_uniqueid_args(" << rank << ", " << nranks << ") failed");
  // nvshmemx_init_attr, without its exit on failure: the error goes to the caller.
  int provided = 0;
  nvshmemi_version_t app = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION};
  nvshmemx_init_init_attr_ver_only(attr);
  const int status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, app);
  DFCCL_CHECK_CODE(status == 0, ErrorCode::kInternal,
                   "dfccl nvshmem: initialisation failed (status " << status << ", rank " << rank << " of " << nranks
                   << "; NVSHMEM_DEBUG=INFO says why)");
  g_init = true;
  switch (nvshmemx_init_status()) {
    case NVSHMEM_STATUS_FULL_MPG: return "FULL_MPG";
    case NVSHMEM_STATUS_LIMITED_MPG: return "LIMITED_MPG";
    case NVSHMEM_STATUS_IS_INITIALIZED: return "IS_INITIALIZED";
    default: return "STATUS_" + std::to_string(nvshmemx_init_status());
  }
}

void Finalize() {
  if (!g_init) return;
  nvshmem_finalize();
  g_init = false;
}

bool Initialized() { return g_init; }

std::vector<CheckRun> Check(const CheckSpec& spec) {
  DFCCL_CHECK(g_init, "dfccl nvshmem: Check before Init");
  DFCCL_CHECK(spec.per_block >= 1 && spec.per_block <= kTasks, "dfccl nvshmem: per_block must be 1.." << kTasks);
  DFCCL_CHECK(spec.msg_bytes >= 8 && spec.msg_bytes % 8 == 0 && spec.msg_bytes <= static_cast<int>(kSlotBytes),
              "dfccl nvshmem: msg_bytes must be a multiple of 8 in 8.." << kSlotBytes);
  DFCCL_CHECK(spec.slots >= 2 && spec.slots <= ann::kMaxSlots, "dfccl nvshmem: slots must be 2.." << ann::kMaxSlots);
  DFCCL_CHECK(spec.pingpong >= 0 && spec.pingpong <= kMaxRoundTrips, "dfccl nvshmem: pingpong at most " << kMaxRoundTrips);
  DFCCL_CHECK(spec.ranks_per_host >= 0 && spec.delay_us >= 0 && spec.delay_us < 1e6,
              "dfccl nvshmem: ranks_per_host >= 0 and 0 <= delay_us < 1 s");
  const int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  DFCCL_CHECK(n <= gpu::kTransportMaxRanks, "dfccl nvshmem: more than " << gpu::kTransportMaxRanks << " PEs");
  ann::Geometry g{n, 8, 2 * n * kTasks + 32, kTasks, spec.slots, kSlotBytes};
  const ann::Layout l = ann::Layout::Of(g);
  const ann::Config c{0, static_cast<uint64_t>(spec.timeout_s * 1e9), 2000000000ull, 1000000000ull};
  KSpec ks{spec.blocks, spec.per_block, spec.msg_bytes, spec.mismatch_every, spec.pingpong, spec.seed,
           static_cast<uint64_t>(spec.timeout_s * 1e9), ann::Layout::Up(l.bytes)};
  const size_t bytes = ks.extra + kSrc + static_cast<size_t>(kTasks) * kSlotBytes;
  KResult* dres = nullptr;
  NV_CUDA(cudaMalloc(&dres, sizeof(KResult)));
  std::vector<CheckRun> runs;
  for (const char* name : {"nvshmem", "store"}) {
    CheckRun run;
    run.transport = name;
    const bool store = std::strcmp(name, "store") == 0;
    if (store && !spec.store) continue;
    char* region = static_cast<char*>(nvshmem_malloc(bytes));  // collective
    DFCCL_CHECK_CODE(region != nullptr, ErrorCode::kResourceExhausted,
                     "dfccl nvshmem: nvshmem_malloc(" << bytes << ") failed (NVSHMEM_SYMMETRIC_SIZE)");
    NV_CUDA(cudaMemset(region, 0, bytes));
    NV_CUDA(cudaMemset(dres, 0, sizeof(KResult)));
    NV_CUDA(cudaDeviceSynchronize());
    nvshmem_barrier_all();
    cudaError_t launched = cudaSuccess;
    const uint64_t delay_ns = static_cast<uint64_t>(spec.delay_us * 1e3);
    if (!store) {
      NvshmemTransport t;
      t.remote = NvshmemTransport::RemoteOf(me, n, spec.ranks_per_host);
      t.delay_ns = delay_ns;
      t.rank = me;
      t.nranks = n;
      t.heap = region;  // (every rank's region at offset 0)
      for (int p = 0; p < n; ++p) t.pe[p] = p;
      CheckKernel<<<1, 1>>>(t, l, c, ks, dres);
      launched = cudaGetLastError();
    } else {
      StoreTransport t;
      t.remote = StoreTransport::RemoteOf(me, n, spec.ranks_per_host);
      t.delay_ns = delay_ns;
      t.rank = me;
      t.nranks = n;
      for (int p = 0; p < n; ++p) {
        t.base[p] = static_cast<char*>(nvshmem_ptr(region, p));
        if (t.base[p] == nullptr) run.skipped = "PE " + std::to_string(p) + " has no load/store address here (nvshmem_ptr)";
      }
      if (run.skipped.empty()) {
        CheckKernel<<<1, 1>>>(t, l, c, ks, dres);
        launched = cudaGetLastError();
      }
    }
    NV_CUDA(launched);
    NV_CUDA(cudaDeviceSynchronize());
    auto held = std::make_unique<KResult>();  // (half a MiB: not on the stack)
    KResult& res = *held;
    NV_CUDA(cudaMemcpy(&res, dres, sizeof(KResult), cudaMemcpyDeviceToHost));
    nvshmem_barrier_all();
    nvshmem_free(region);
    if (run.skipped.empty()) {
      run.ok = res.ok;
      run.failed_as_expected = res.failed_as_expected;
      run.wrong = res.wrong + (res.done ? 0 : 1);
      run.cap_refused = res.cap_refused != 0;
      run.seconds = res.t_ns * 1e-9;
      if (res.wrong) run.first_error = Describe(res);
      else if (!res.done) run.first_error = "the check kernel stopped early";
      if (me == 0)
        for (int k = 0; k < std::min(spec.pingpong, kMaxRoundTrips); ++k) run.round_trip_us.push_back(res.rt_ns[k] * 1e-3);
    }
    runs.push_back(run);
  }
  cudaFree(dres);
  return runs;
}

namespace {

// Exact in float32: small integers (input of PE r at element i).
float NativeVal(int r, int64_t i) { return static_cast<float>((r + 1) * 16 + static_cast<int>(i % 13)); }

enum class NativeOp { kPsum, kAllGather, kAllToAll };
const char* const kNativeNames[] = {"psum", "all_gather", "all_to_all"};

// One call of `op` on `st` (src, dst symmetric; nel: each PE's input elements).
void NativeCall(NativeOp op, float* dst, const float* src, size_t nel, int n, cudaStream_t st) {
  int rc = 0;
  if (op == NativeOp::kPsum) rc = nvshmemx_float_sum_reduce_on_stream(NVSHMEM_TEAM_WORLD, dst, src, nel, st);
  else if (op == NativeOp::kAllGather) rc = nvshmemx_float_fcollect_on_stream(NVSHMEM_TEAM_WORLD, dst, src, nel, st);
  else rc = nvshmemx_float_alltoall_on_stream(NVSHMEM_TEAM_WORLD, dst, src, nel / n, st);
  DFCCL_CHECK_CODE(rc == 0, ErrorCode::kInternal, "dfccl nvshmem: NVSHMEM's " << kNativeNames[static_cast<int>(op)]
                   << " of " << nel * 4 << " bytes returned " << rc);
}

}  // namespace

std::vector<NativeRow> Native(const NativeSpec& spec) {
  DFCCL_CHECK(g_init, "dfccl nvshmem: Native before Init");
  DFCCL_CHECK(spec.op == "psum" || spec.op == "all_gather" || spec.op == "all_to_all",
              "dfccl nvshmem: op must be psum, all_gather or all_to_all, got '" << spec.op << "'");
  DFCCL_CHECK(spec.iters >= 1 && spec.reps >= 1, "dfccl nvshmem: iters and reps must be >= 1");
  const NativeOp op = spec.op == "psum" ? NativeOp::kPsum : spec.op == "all_gather" ? NativeOp::kAllGather
                                                                                      : NativeOp::kAllToAll;
  const int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  int64_t most = 0;
  for (int64_t b : spec.bytes) {
    DFCCL_CHECK(b > 0 && b % (op == NativeOp::kAllToAll ? 4 * n : 4) == 0,
                "dfccl nvshmem: " << b << " bytes: a positive multiple of " << (op == NativeOp::kAllToAll ? 4 * n : 4));
    most = std::max(most, b);
  }
  const size_t out_bytes = static_cast<size_t>(most) * (op == NativeOp::kAllGather ? n : 1);
  float* src = static_cast<float*>(nvshmem_malloc(static_cast<size_t>(most)));  // collective
  float* dst = static_cast<float*>(nvshmem_malloc(out_bytes));
  DFCCL_CHECK_CODE(src != nullptr && dst != nullptr, ErrorCode::kResourceExhausted,
                   "dfccl nvshmem: nvshmem_malloc of " << most + out_bytes << " bytes failed (NVSHMEM_SYMMETRIC_SIZE)");
  cudaStream_t st = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  NV_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  NV_CUDA(cudaEventCreate(&e0));
  NV_CUDA(cudaEventCreate(&e1));
  std::vector<NativeRow> rows;
  for (int64_t b : spec.bytes) {
    const size_t nel = static_cast<size_t>(b) / 4, out_el = op == NativeOp::kAllGather ? nel * n : nel;
    std::vector<float> h(nel), got(out_el), want(out_el);
    for (size_t i = 0; i < nel; ++i) h[i] = NativeVal(me, static_cast<int64_t>(i));
    for (size_t i = 0; i < out_el; ++i) {
      if (op == NativeOp::kPsum) {
        float s = 0;
        for (int q = 0; q < n; ++q) s += NativeVal(q, static_cast<int64_t>(i));
        want[i] = s;
      } else if (op == NativeOp::kAllGather) {
        want[i] = NativeVal(static_cast<int>(i / nel), static_cast<int64_t>(i % nel));
      } else {  // block q of the output: PE q's block `me`
        const size_t per = nel / n, q = i / per;
        want[i] = NativeVal(static_cast<int>(q), static_cast<int64_t>(me * per + i % per));
      }
    }
    NV_CUDA(cudaMemcpyAsync(src, h.data(), static_cast<size_t>(b), cudaMemcpyHostToDevice, st));
    NV_CUDA(cudaMemsetAsync(dst, 0, out_el * 4, st));
    nvshmemx_barrier_all_on_stream(st);
    NativeCall(op, dst, src, nel, n, st);
    NV_CUDA(cudaMemcpyAsync(got.data(), dst, out_el * 4, cudaMemcpyDeviceToHost, st));
    NV_CUDA(cudaStreamSynchronize(st));
    NativeRow row;
    row.bytes = b;
    for (size_t i = 0; i < out_el; ++i) row.max_err = std::max(row.max_err, static_cast<double>(std::abs(got[i] - want[i])));
    row.exact = row.max_err == 0;
    for (int r = -1; r < spec.reps; ++r) {  // (r = -1: warm-up)
      nvshmemx_barrier_all_on_stream(st);
      NV_CUDA(cudaEventRecord(e0, st));
      for (int k = 0; k < spec.iters; ++k) NativeCall(op, dst, src, nel, n, st);
      NV_CUDA(cudaEventRecord(e1, st));
      NV_CUDA(cudaEventSynchronize(e1));
      float ms = 0;
      NV_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 0) row.us.push_back(ms * 1e3 / spec.iters);
    }
    rows.push_back(row);
  }
  nvshmemx_barrier_all_on_stream(st);
  NV_CUDA(cudaStreamSynchronize(st));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(st);
  nvshmem_free(dst);
  nvshmem_free(src);
  return rows;
}

}  // namespace dfccl::nvshm
