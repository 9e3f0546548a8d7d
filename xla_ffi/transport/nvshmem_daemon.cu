// The NVSHMEM module's DaemonEngine (device/daemon.h): the daemon compiled with
// NVSHMEM under its announced communicators (device/daemon_kernel.cu and
// device/announce_setup.cu, built here with DFCCL_DAEMON_NVSHMEM), and their regions
// carved from one symmetric allocation.
//
// One GPU per process (NVSHMEM's one PE per process): the allocation is on the
// device current when NVSHMEM was initialised, which jax_dfccl makes the
// process's GPU (jax_dfccl/_src/nvshmem.py).
//
// The allocation (Heap) is made by every PE at once, once, when NVSHMEM is set up
// (jax_dfccl.initialize), outside any execution: nvshmem_malloc is collective over
// every PE of the job, while communicators are set up by their members alone and in
// each process's own order (MPMD).  So each process carves its regions from its own
// copy of the allocation, in its own order, and a region's offset travels to the
// group's other members in the exchange blob (NvshmemTransport::at).
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <mutex>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "transport/nvshmem_engine.h"

namespace dfccl::nvshm {
namespace {

#define NV_CUDA(call) DFCCL_CHECK_CUDA(call, "dfccl nvshmem")

constexpr uint64_t kAlign = 256;

std::mutex g_mu;
char* g_heap = nullptr;     // this PE's address of the allocation
uint64_t g_bytes = 0, g_used = 0;

char* RegionAlloc(uint64_t bytes, uint64_t* offset) {
  std::lock_guard lk(g_mu);
  DFCCL_CHECK_CODE(g_heap != nullptr, ErrorCode::kFailedPrecondition,
                   "dfccl: NVSHMEM's region for groups spanning hosts is not set up (jax_dfccl.initialize)");
  const uint64_t at = (g_used + kAlign - 1) / kAlign * kAlign;
  DFCCL_CHECK_CODE(at + bytes <= g_bytes, ErrorCode::kResourceExhausted,
                   "dfccl: NVSHMEM's region for groups spanning hosts is full (" << g_bytes << " bytes, " << at
                   << " in use, " << bytes << " more asked for by a group's set-up): raise "
                   "jax_dfccl.config.cross_host_region_bytes (every process alike)");
  // (on a stream of its own: the daemon, a persistent kernel, may run meanwhile)
  cudaStream_t s = nullptr;
  NV_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaError_t e = cudaMemsetAsync(g_heap + at, 0, bytes, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  NV_CUDA(e);
  g_used = at + bytes;
  *offset = at;
  return g_heap + at;
}

int32_t Pe() { return g_heap ? nvshmem_my_pe() : -1; }

// This module links its own CUDA runtime, whose current device is its own: each
// entry that launches or copies takes the device of the stream it is given.
cudaError_t OnStreamDevice(cudaStream_t stream) {
  int dev = 0;
  const cudaError_t e = cudaStreamGetDevice(stream, &dev);
  return e == cudaSuccess ? cudaSetDevice(dev) : e;
}

// Each thread's stack: the daemon calls its lane functions through pointers, so
// its stack size is the linker's estimate (nvlink -v: 1160 bytes, the kernel's
// frame and the largest lane function's), which leaves out what NVSHMEM's device
// functions under a put take (the check kernel, the same protocol without the
// pointers: 2560 bytes, 432 over direct stores); the default 1 KiB per thread
// overflowed (an illegal address on the testbed).  Raised once per device, at its
// first (warm) launch, while none of the daemon's kernels runs.
constexpr size_t kDaemonStackBytes = 4096;

cudaError_t Launch(const gpu::DaemonParams& p, cudaStream_t stream) {
  cudaError_t e = OnStreamDevice(stream);
  size_t stack = 0;
  if (e == cudaSuccess) e = cudaDeviceGetLimit(&stack, cudaLimitStackSize);
  if (e == cudaSuccess && stack < kDaemonStackBytes) e = cudaDeviceSetLimit(cudaLimitStackSize, kDaemonStackBytes);
  return e == cudaSuccess ? gpu::LaunchDaemon(p, stream) : e;
}

cudaError_t ViewInit(const gpu::AnnounceSetup& s, void* view, cudaStream_t stream) {
  const cudaError_t e = OnStreamDevice(stream);
  return e == cudaSuccess ? gpu::AnnounceInit(s, view, stream) : e;
}

cudaError_t ViewConfig(void* view, uint64_t timeout_ns, uint64_t grace_ns, uint64_t generation, cudaStream_t stream) {
  const cudaError_t e = OnStreamDevice(stream);
  return e == cudaSuccess ? gpu::AnnounceSetConfig(view, timeout_ns, grace_ns, generation, stream) : e;
}

}  // namespace

void Heap(uint64_t bytes) {
  std::lock_guard lk(g_mu);
  DFCCL_CHECK(Initialized(), "dfccl nvshmem: Heap before Init");
  DFCCL_CHECK(g_heap == nullptr, "dfccl nvshmem: the region for groups spanning hosts is already allocated");
  DFCCL_CHECK(bytes > 0 && bytes % kAlign == 0, "dfccl nvshmem: the region's size must be a positive multiple of " << kAlign);
  char* p = static_cast<char*>(nvshmem_malloc(bytes));  // collective
  DFCCL_CHECK_CODE(p != nullptr, ErrorCode::kResourceExhausted,
                   "dfccl nvshmem: nvshmem_malloc(" << bytes << ") failed: NVSHMEM's symmetric heap "
                   "(NVSHMEM_SYMMETRIC_SIZE) must hold jax_dfccl.config.cross_host_region_bytes");
  g_heap = p;
  g_bytes = bytes;
  g_used = 0;
}

void ReleaseHeap() {
  std::lock_guard lk(g_mu);
  if (g_heap) nvshmem_free(g_heap);  // collective
  g_heap = nullptr;
  g_bytes = g_used = 0;
}

uintptr_t DaemonEngineAddress() {
  static const gpu::DaemonEngine e{"nvshmem", &Launch, &gpu::AnnounceRegionBytes, &RegionAlloc,
                                   &Pe,       &gpu::AnnounceViewBytes, &ViewInit, &ViewConfig};
  return reinterpret_cast<uintptr_t>(&e);
}

}  // namespace dfccl::nvshm
