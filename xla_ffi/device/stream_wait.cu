// The copy-engine path's done wait: one thread on XLA's stream polls the
// instance's completion word in host memory (ld.acquire.sys, GEQ on the
// generation as cuStreamWaitValue32 does) with short sleeps (device/wait.cuh
// HostWordWait).  Bounded like the daemon path's done wait (device/submit.cuh
// WaitDone): the host writes the word when the copies complete, when it aborts
// the instance (its watchdog, after config.timeout_s) or fails to issue it, so
// a word still unwritten after the bound means the host's mover is gone; the
// kernel then says what it waited for and traps (a hang is the alternative).
#include <cstdio>

#include "device/daemon.h"
#include "device/wait.cuh"

namespace dfccl::gpu {
namespace {

__global__ void StreamWaitKernel(const uint32_t* addr, uint32_t value, int64_t timeout_ns, uint64_t ticket) {
  SpinWaitOrTrap<HostWordWait>([&] { return static_cast<int32_t>(LdAcquireSys(addr) - value) >= 0; },
                               static_cast<uint64_t>(timeout_ns), NoAbort{}, [&](WaitEnd) {
                                 printf("dfccl: copy-engine done wait of ticket %llu (generation %u) gave up after "
                                        "%lld ns (host copy-engine mover gone?)\n",
                                        static_cast<unsigned long long>(ticket), value,
                                        static_cast<long long>(timeout_ns));
                               });
}

}  // namespace

cudaError_t PreloadStreamWait() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, StreamWaitKernel);
}

cudaError_t LaunchStreamWait(cudaStream_t stream, const uint32_t* addr, uint32_t value, int64_t timeout_ns,
                             uint64_t ticket) {
  StreamWaitKernel<<<1, 1, 0, stream>>>(addr, value, timeout_ns, ticket);
  return cudaGetLastError();
}

}  // namespace dfccl::gpu
