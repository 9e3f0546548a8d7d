// AG push kernel (side stream, few SMs): copies this rank's x rows, kTileM-row
// chunks in kPieces work items each, into each peer's gather buffer slot `rank`
// and raises the chunk's arrival flag on the peer (protocol in protocol.h).
// Peers are served in the order they need the rows: rank-1 computes our block
// right after its own, rank+1 last.
#include "overlap/launch.h"
#include "overlap/sync.cuh"

namespace dfccl::overlap {
namespace {

// A chunk is pushed in kPieces pieces by different CTAs (more SMs on NVLink);
// the CTA that completes a chunk's last piece (local arrival counter, +1 per
// piece and instance, so `% kPieces` needs no reset) raises the peer's flag.
constexpr int kPieces = 4;

__global__ void __launch_bounds__(512) PushKernel(PushLaunch a) {
  __shared__ uint64_t s_dst;
  __shared__ uint32_t* s_flags;
  __shared__ bool s_last;
  const int mtiles = (a.m + kTileM - 1) / kTileM;
  const int items = (a.nranks - 1) * mtiles * kPieces;
  const char* x = static_cast<const char*>(a.x);
  for (int it = blockIdx.x; it < items; it += gridDim.x) {
    const int j = it / (mtiles * kPieces) + 1, c = (it / kPieces) % mtiles, piece = it % kPieces;
    const int d = (a.rank - j + a.nranks) % a.nranks;
    if (threadIdx.x == 0) {
      // d's stream reached instance seq: its gather buffer is free for us.
      const bool ok = WaitReady(a.ready_in != nullptr ? a.ready_in + d : nullptr, &a.mbox->ready[d], a.seq, a.mbox,
                                a.timeout_ns, ErrorCode(kWaitPushReady, a.rank, d));
      s_dst = ok ? LoadMailboxPtr(&a.mbox->recv[d]) : 0;
      s_flags = ok ? reinterpret_cast<uint32_t*>(LoadMailboxPtr(&a.mbox->flags[d])) : nullptr;
    }
    __syncthreads();
    if (s_dst != 0) {
      const int rows = min(kTileM, a.m - c * kTileM);
      const int per = (rows + kPieces - 1) / kPieces, r0 = min(rows, piece * per), r1 = min(rows, r0 + per);
      const size_t off = (size_t(c) * kTileM + r0) * a.row_bytes;
      const int4* src = reinterpret_cast<const int4*>(x + off);
      int4* dst = reinterpret_cast<int4*>(reinterpret_cast<char*>(s_dst) + size_t(a.rank) * a.m * a.row_bytes + off);
      const size_t nvec = size_t(r1 - r0) * a.row_bytes / 16;
      for (size_t i = threadIdx.x; i < nvec; i += blockDim.x) dst[i] = src[i];
      __threadfence_system();  // each thread: its remote stores before the arrival count / flag
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const uint32_t old = atomicAdd(a.counters + (j - 1) * mtiles + c, 1u);
      __threadfence_system();  // the other pieces' stores (fenced before their increments) precede our flag
      s_last = (old + 1) % kPieces == 0;
    }
    __syncthreads();
    if (threadIdx.x == 0 && s_last && s_flags != nullptr) StReleaseSys(&s_flags[a.rank * mtiles + c], a.seq);
    __syncthreads();  // s_dst / s_flags are rewritten by the next item
  }
}

// Copy-engine path (protocol.h): the copy is stream-ordered between these two.
__global__ void ReadyWaitKernel(SideSync s) {
  if (threadIdx.x != 0) return;
  if (s.tl) s.tl[0] = GlobalTimer();
  if (s.counter) WaitGeq(s.counter, s.target, s.mbox, s.timeout_ns, ErrorCode(kWaitOwnTiles, s.rank, s.rank));
  WaitReady(s.ready_local, &s.mbox->ready[s.peer], s.seq, s.mbox, s.timeout_ns,
            ErrorCode(kWaitPushReady, s.rank, s.peer));
  if (s.tl) s.tl[1] = GlobalTimer();
}

__global__ void SignalKernel(SideSync s) {
  if (threadIdx.x == 0) {
    if (s.tl) s.tl[2] = GlobalTimer();
    __threadfence_system();  // the preceding copy's writes before any flag
  }
  __syncthreads();
  for (int i = threadIdx.x; i < s.count; i += blockDim.x) StReleaseSys(s.flags + i, s.seq);
}

}  // namespace

cudaError_t LaunchReadyWait(const SideSync& s, cudaStream_t stream) {
  ReadyWaitKernel<<<1, 32, 0, stream>>>(s);
  return cudaGetLastError();
}

cudaError_t LaunchSignal(const SideSync& s, cudaStream_t stream) {
  if (s.count <= 0) return cudaSuccess;
  SignalKernel<<<1, 128, 0, stream>>>(s);
  return cudaGetLastError();
}

cudaError_t PreloadSideKernels() {
  cudaFuncAttributes a;
  for (const void* f : {reinterpret_cast<const void*>(PushKernel), reinterpret_cast<const void*>(ReadyWaitKernel),
                        reinterpret_cast<const void*>(SignalKernel)})
    if (const cudaError_t e = cudaFuncGetAttributes(&a, f); e != cudaSuccess) return e;
  return cudaSuccess;
}

cudaError_t LaunchPush(const PushLaunch& a, cudaStream_t stream) {
  if (a.nranks <= 1 || a.m == 0) return cudaSuccess;
  PushKernel<<<a.grid, 512, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace dfccl::overlap
