// The shared part of the GPU host runtime (context.h): a device's setup
// (host-mapped queues, device state, the warm daemon launch), the lookups of
// devices and communicators, the handlers' lock, the error log.
// Lock: every function here runs under Context::mu (HandlerLock takes it),
// except GetDeviceFast, FlagsFor and ThrowIfFailed's check, the hot path's.
#include "runtime/context.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "dfccl/host.h"
#include "runtime/communicator.h"
#include "runtime/driver.h"
#include "runtime/proxy.h"

#define DFCCL_CUDA(call) DFCCL_CHECK_CUDA(call, "dfccl")

namespace dfccl::gpu {

void CopyOut(Device& d, void* dst, const void* src, size_t bytes) {
  DeviceGuard guard(d.ordinal);
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, d.aux);
  if (e == cudaSuccess) e = cudaStreamSynchronize(d.aux);
  // A failed call stays this thread's last error: cleared here, so that the next
  // launch's check (cudaGetLastError) does not report it as its own.
  if (e != cudaSuccess) cudaGetLastError();
  DFCCL_CHECK_CODE(e == cudaSuccess, ::dfccl::ErrorCode::kInternal, "dfccl: reading device counters: " << cudaGetErrorString(e));
}

// The handlers' lock: a short spin before sleeping.  XLA's device threads run
// the same program in step and reach it together; a futex sleep and wake-up
// per call would cost more than the section it guards.
std::unique_lock<std::timed_mutex> Context::HandlerLock() {
  for (int i = 0; i < 4096; ++i) {
    if (mu.try_lock()) return std::unique_lock<std::timed_mutex>(mu, std::adopt_lock);
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return std::unique_lock<std::timed_mutex>(mu);
}

// Under mu.  Also printed at once: inside a command buffer the collective's
// kernel then traps, and the process may end before any exception carries it.
void Context::RecordError(const std::string& message) {
  static int printed = 0;  // (a failed group can fail hundreds of pending instances at once)
  if (printed < 8) std::fprintf(stderr, "%s\n", message.c_str());
  else if (printed == 8) std::fprintf(stderr, "dfccl: more errors: jax_dfccl.stats()['cuda']['errors']\n");
  printed++;
  errors.push_back(message);
  if (errors.size() > kMaxErrors) errors.erase(errors.begin());
}

void Context::SetSharing(Device& d, int processes) {
  if (processes <= d.sharing) return;
  d.sharing = processes;
  int sms = 0;
  DFCCL_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d.ordinal));
  d.worker_cap = std::max(1, sms / processes - 1);  // (its control block takes one more)
}

Device& Context::GetDevice(int ordinal) {
  auto it = devices.find(ordinal);
  if (it != devices.end()) return *it->second;
  DeviceGuard guard(ordinal);
  auto d = std::make_unique<Device>();
  d->ordinal = ordinal;
  DFCCL_CUDA(cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking));
  DFCCL_CUDA(cudaStreamCreateWithFlags(&d->aux, cudaStreamNonBlocking));
  DFCCL_CUDA(cudaEventCreateWithFlags(&d->ev, cudaEventDisableTiming));
  DFCCL_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&d->host), sizeof(HostShared),
                           cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(static_cast<void*>(d->host), 0, sizeof(HostShared));
  DFCCL_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d->host_dev), d->host, 0));
  DFCCL_CUDA(cudaMalloc(reinterpret_cast<void**>(&d->dev), sizeof(DeviceShared)));
  DFCCL_CUDA(cudaMemsetAsync(d->dev, 0, sizeof(DeviceShared), d->aux));
  DFCCL_CUDA(cudaStreamSynchronize(d->aux));
  DFCCL_CUDA(PreloadStreamWait());
  DFCCL_CUDA(PreloadSubmitKernels());
  DFCCL_CUDA(PreloadReduceKernels());
  // The daemon needs local memory per thread (its stack: 528 bytes, ptxas).
  // A launch that needs more local memory than the context holds makes the driver
  // grow it, and growing waits inside cuLaunchKernel for the device's running
  // kernels: a larger daemon (Launch on a large message) launched while XLA's
  // stream spins in one of our done waits would wait for that wait, under the
  // runtime lock - a hang.  So the largest grid is launched once here, while none
  // of ours runs, and exits at once (its quit request is set before the launch);
  // the driver keeps the grown size.
  d->launch_id = 1;
  d->host->resize = d->launch_id;
  DaemonParams warm{};
  warm.dev = d->dev;
  warm.host = d->host_dev;
  warm.launch_id = d->launch_id;
  warm.workers = kMaxBlocks - 1;
  DFCCL_CUDA(engine->launch(warm, d->stream));
  DFCCL_CUDA(cudaStreamSynchronize(d->stream));
  d->blocks_launched = warm.workers + 1;
  d->host->resize = 0;
  ce.Prepare(ordinal);
  auto& ref = *d;
  DFCCL_CHECK(ordinal >= 0 && ordinal < static_cast<int>(by_ordinal.size()), "dfccl: GPU ordinal " << ordinal);
  by_ordinal[ordinal].store(d.get(), std::memory_order_release);
  devices[ordinal] = std::move(d);
  proxy->Start();
  return ref;
}

Device& Context::GetDeviceFast(int ordinal) {
  Device* d = ordinal >= 0 && ordinal < static_cast<int>(by_ordinal.size())
                  ? by_ordinal[ordinal].load(std::memory_order_acquire) : nullptr;
  DFCCL_CHECK_CODE(d != nullptr, ErrorCode::kFailedPrecondition, "dfccl: a done on GPU " << ordinal << " before any start");
  return *d;
}

int Context::OrdinalOf(int64_t global) const {
  if (ordinal_of.empty()) return static_cast<int>(global);  // one process: ids are ordinals
  auto it = ordinal_of.find(global);
  return it == ordinal_of.end() ? -1 : it->second;
}

int64_t Context::GlobalOf(int ordinal) const {
  if (global_of.empty()) return ordinal;
  auto it = global_of.find(ordinal);
  return it == global_of.end() ? -1 : it->second;
}

Communicator& Context::GetComm(const std::vector<int64_t>& group) {
  auto it = comms.find(group);
  if (it != comms.end()) {
    DFCCL_CHECK_CODE(it->second->ready, ErrorCode::kFailedPrecondition,
                     "dfccl: the group of devices [" << GroupText(group) << "] spans processes and its memory "
                     "was not exchanged yet (jax_dfccl.initialize() in every process, then the program is "
                     "lowered in every process)");
    return *it->second;
  }
  for (auto g : group)
    DFCCL_CHECK_CODE(OrdinalOf(g) >= 0, ErrorCode::kFailedPrecondition,
                     "dfccl: the group of devices [" << GroupText(group) << "] spans processes: call "
                     "jax_dfccl.initialize() after jax.distributed.initialize() in every process");
  auto c = std::make_unique<Communicator>(*this, group, false);
  for (int r = 0; r < c->n; ++r) c->AllocRank(r);
  c->Publish();
  auto& ref = *c;
  comms[group] = std::move(c);
  return ref;
}

std::string GroupText(const std::vector<int64_t>& group) {
  std::string s;
  for (size_t i = 0; i < group.size(); ++i) s += (i ? "," : "") + std::to_string(group[i]);
  return s;
}

// What the kernels of one call need to know: inside a command buffer (no handler
// will report a failure: trap), tracing, the bound of their waits.
KernelFlags Context::FlagsFor(cudaStream_t stream) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  DFCCL_CHECK_CUDA(cudaStreamIsCapturing(stream, &cap), "dfccl: stream capture state");
  return KernelFlags{cap != cudaStreamCaptureStatusNone ? 1 : 0, trace.load(std::memory_order_relaxed) ? 1 : 0,
                     static_cast<int64_t>((2 * timeout_s.load(std::memory_order_relaxed) + 10) * 1e9)};
}

void Context::ThrowIfFailed(Device& d) {
  if (!d.has_error.load(std::memory_order_acquire)) return;
  auto lk = HandlerLock();
  if (!d.error.ok()) ThrowDeviceError(d);
}

void Context::ThrowDeviceError(Device& d) {
  const Status e = d.error;
  if (d.error_once) {
    d.error = Status{};
    d.error_once = false;
    d.has_error.store(false, std::memory_order_release);
  }
  e.Throw();
}

}  // namespace dfccl::gpu
