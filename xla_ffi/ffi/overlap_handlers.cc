// The FFI handlers of the fused overlap ops (ffi/overlap_handlers.h): the
// launch of one instance's kernels on one rank (overlap/: GEMM, push, side
// copies), between the fused-op path's Begin and Commit (runtime/overlap_path.h),
// which make it a collective of its group's communicator: (group, key,
// sequence), counts, trace, pending report, deadline and failures with the
// runtime's codes and words (docs/design/overlap.md "Keys, counts and failures").
// A handler never blocks on another device: it enqueues (ready write, kernels,
// done write) and returns; all cross-rank waits happen in the kernels, bounded
// by config.timeout_s (overlap/protocol.h).
#include "ffi/overlap_handlers.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dfccl/check.h"
#include "ffi/error.h"
#include "overlap/launch.h"
#include "overlap/plan.h"
#include "overlap/profile.h"
#include "runtime/driver.h"
#include "runtime/runtime.h"

namespace ffi = xla::ffi;

namespace dfccl::overlap {
namespace {

using gpu::OverlapPath;
using Prologue = OverlapPath::Call;
using RankState = OverlapPath::RankState;
using DeviceState = OverlapPath::PerDevice;
using prof::HostTimer;
using prof::Keep;
using prof::KeepTimeline;
using prof::Mark;
using prof::TimelineAlloc;

struct Group {
  int rank = -1;
  std::vector<int> devs;
};

// The kernels' part of a device's set-up (OverlapPath::Device): before
// anything of ours runs on the device (launch.h), every kernel loaded.
void InitDevice(DeviceState& d) {
  OV_CUDA(PreloadGemmBF16());
  OV_CUDA(PreloadGemmF16());
  OV_CUDA(PreloadSideKernels());
  int bf16 = 0, f16 = 0;
  OV_CUDA(GemmClusterCtasBF16(&bf16));
  OV_CUDA(GemmClusterCtasF16(&f16));
  d.cluster_ctas = std::min(bf16, f16);
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

// The bound of every wait of a fused op's kernels is Call::timeout_ns:
// jax_dfccl.config.timeout_s, the one user timeout (the runtime fails the
// instance at the same bound, counted from the moment this rank's stream
// reached it: OverlapPath::PollChannel).
ffi::Error AgImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> xg, std::string_view key,
                  ffi::Span<const int64_t> devices, int32_t group_size, int32_t mode) {
  return dfccl::FfiGuard([&] {
    OverlapPath& path = gpu::Runtime::Get().overlap();
    path.ThrowIfFailed(ordinal);
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
    DeviceState& dev = path.Device(ordinal, &InitDevice);
    const Prologue pro = path.Begin(stream, ordinal, key, kAllGatherGemm, g.devs, g.rank, size_t(P) * m * K * esz,
                                    P * mtiles, 1 + P * mtiles);
    const int64_t timeout_ns = pro.timeout_ns;
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
    path.Commit(stream, pro);
  });
}

ffi::Error RsImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Result<ffi::AnyBuffer> out, std::string_view key, ffi::Span<const int64_t> devices,
                  int32_t group_size, int32_t mode) {
  return dfccl::FfiGuard([&] {
    OverlapPath& path = gpu::Runtime::Get().overlap();
    path.ThrowIfFailed(ordinal);
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
    DeviceState& dev = path.Device(ordinal, &InitDevice);
    // Flags for the narrowest tiles (the most per block), whatever this call picks.
    const Prologue pro = path.Begin(stream, ordinal, key, kGemmReduceScatter, g.devs, g.rank, size_t(P) * mb * N * esz,
                                    size_t(P) * mtiles * ((N + kTileNMin - 1) / kTileNMin), 1 + P);
    const int64_t timeout_ns = pro.timeout_ns;
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
    path.Commit(stream, pro);
  });
}

}  // namespace

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
