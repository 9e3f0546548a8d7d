// Host entry points into the device code: the daemon (daemon_kernel.cu), the
// done-wait kernel (stream_wait.cu) and the copy-engine path's combine (reduce_kernel.cu).
#pragma once

#include <cuda_runtime.h>

#include "dfccl/collective.h"
#include "device/task.h"

// The daemon is built twice where NVSHMEM is found: into _dfccl_cuda (its announced
// communicators reached by direct stores) and into _dfccl_nvshmem (DFCCL_DAEMON_NVSHMEM:
// by NVSHMEM).  The second build's entry points live in an inline namespace of their
// own, so the two modules never share a symbol.
#if defined(DFCCL_DAEMON_NVSHMEM)
#define DFCCL_DAEMON_BUILD_BEGIN inline namespace over_nvshmem {
#define DFCCL_DAEMON_BUILD_END }
#else
#define DFCCL_DAEMON_BUILD_BEGIN
#define DFCCL_DAEMON_BUILD_END
#endif

namespace dfccl::gpu {

// Protocol "announce" (device/announce_path.cuh): a communicator spanning hosts,
// matched by announcements.  One rank's set-up: its geometry, deadlines and the
// members' regions as its daemon's transport reaches them (DaemonEngine):
//   direct stores  regions[q]: rank q's region as this GPU reaches it (regions[rank]
//                  its own, on the current device, zeroed);
//   NVSHMEM        at[q], pe[q]: rank q's region's offset in the engine's symmetric
//                  allocation, and q's PE (regions[rank] the own one's address).
// AnnounceInit writes its region's initial state and its view (AnnounceViewBytes of
// device memory at `view`) on `stream`.
struct AnnounceSetup {
  int rank = 0, nranks = 0;
  int depth = 0, entries = 0, tasks = 0, slots = 0;  // ann::Geometry (transport/announce_layout.cuh)
  uint32_t slot_bytes = 0;                           // the largest message (a member's input)
  uint32_t group = 0;                                // equal on every rank
  uint64_t timeout_ns = 0, grace_ns = 0;
  uint64_t remote = 0, delay_ns = 0;                 // ranks of other hosts; each put to one delayed (a test setting)
  char* regions[kMaxRanks] = {};
  uint64_t at[kMaxRanks] = {};
  int32_t pe[kMaxRanks] = {};
};

// One build of the daemon and what goes with it: the kernel, and the announced
// communicators as its transport has them.  _dfccl_cuda's (ThisDaemonEngine there:
// "stores", regions by cudaMalloc, reached by peer access or CUDA IPC) is the
// runtime's default; _dfccl_nvshmem's ("nvshmem", regions carved from one symmetric
// allocation made when NVSHMEM was set up) replaces it once NVSHMEM is initialised,
// before the runtime's first daemon starts (Runtime::SetDaemonEngine).
struct DaemonEngine {
  const char* name;  // "stores" or "nvshmem"
  // Launches one daemon (params.workers worker blocks + 1 control block) on `stream`.
  cudaError_t (*launch)(const DaemonParams& params, cudaStream_t stream);
  uint64_t (*region_bytes)(const AnnounceSetup& s);
  // A region of `bytes` on the current device, zeroed, and its offset in the
  // engine's symmetric allocation; null where the engine has none (the caller
  // allocates it, and exports it by CUDA IPC).  Throws dfccl::Error when full.
  // A region lives as long as the process (as a communicator does).
  char* (*region_alloc)(uint64_t bytes, uint64_t* offset);
  int32_t (*pe)();  // this process's PE (-1: the engine has none)
  size_t (*view_bytes)();
  cudaError_t (*announce_init)(const AnnounceSetup& s, void* view, cudaStream_t stream);
  // The view's deadlines (config.timeout_s changed) and generation (reset()); returns once written.
  cudaError_t (*set_config)(void* view, uint64_t timeout_ns, uint64_t grace_ns, uint64_t generation,
                            cudaStream_t stream);
};

DFCCL_DAEMON_BUILD_BEGIN
// This module's build of the daemon (announce_setup.cu).
const DaemonEngine& ThisDaemonEngine();
cudaError_t LaunchDaemon(const DaemonParams& params, cudaStream_t stream);
uint64_t AnnounceRegionBytes(const AnnounceSetup& s);
size_t AnnounceViewBytes();
cudaError_t AnnounceInit(const AnnounceSetup& s, void* view, cudaStream_t stream);
cudaError_t AnnounceSetConfig(void* view, uint64_t timeout_ns, uint64_t grace_ns, uint64_t generation,
                              cudaStream_t stream);
DFCCL_DAEMON_BUILD_END

// The kernels of a collective on XLA's stream (submit_kernel.cu): the submit
// kernel (the ready signal; the blocking form also waits) and the done wait;
// pdl: launched with programmatic stream serialization (config.tuning.submit_pdl).
cudaError_t LaunchSubmit(const SubmitParams& p, cudaStream_t stream, bool pdl);
cudaError_t LaunchDone(const DoneParams& p, cudaStream_t stream, bool pdl);
// The launch id of the execution whose thunks follow on `stream`, into
// DeviceShared::run_word (protocol "run" in device/task.h): one thread.
cudaError_t LaunchRunWord(DeviceShared* dev, uint32_t run, cudaStream_t stream);
// A start form's copy of its operand into its call site's slot (device/task.h, "staged").
cudaError_t LaunchStage(const StageParams& p, cudaStream_t stream);
// The blocking form's inline submit kernel (daemon_kernel.cu; LaunchSubmit picks
// it when p.inline_ns > 0 and p.inline_kernel is set): one block of kThreads
// that runs the matched task itself for a while.  One kernel per (op kind,
// element type, reduce op): InlineSubmitKernelFor gives a call site's (the
// fields of its TaskDesc).
InlineSubmitFn InlineSubmitKernelFor(int32_t kind, int32_t dtype, int32_t reduce);
cudaError_t PreloadInlineSubmit();

// Enqueues on `stream` a one-thread kernel that returns once (int32_t)(*addr - value) >= 0
// (the copy-engine path's done wait on its host-memory word), or prints the
// ticket and traps once timeout_ns have passed without it.
cudaError_t LaunchStreamWait(cudaStream_t stream, const uint32_t* addr, uint32_t value, int64_t timeout_ns,
                             uint64_t ticket);

// Enqueues on `stream`: out = reduce(out, in) element-wise over `bytes` (a whole
// number of elements), with at most `max_blocks` blocks.
cudaError_t LaunchReduceInto(cudaStream_t stream, DType dtype, ReduceOp reduce, char* out, const char* in,
                             int64_t bytes, int max_blocks);


// Load the side kernels on the current device now (lazy loading would load them
// at first launch, synchronizing the context while other kernels spin).
cudaError_t PreloadStreamWait();
cudaError_t PreloadSubmitKernels();
cudaError_t PreloadReduceKernels();

}  // namespace dfccl::gpu
