// The host's side of protocol "announce" (device/task.h, device/announce_path.cuh):
// a rank's region size for a geometry, and its region's initial state with its
// view (the members' regions, the layout, the deadlines) written to the device;
// and this module's DaemonEngine (device/daemon.h), which bundles them with the
// daemon's launch.  Compiled into _dfccl_cuda (direct stores) and, with
// DFCCL_DAEMON_NVSHMEM, into _dfccl_nvshmem (NVSHMEM: its regions come from
// transport/nvshmem_engine.cu's symmetric allocation).
#include <cstddef>

#include "device/announce_view.cuh"
#include "device/daemon.h"

namespace dfccl::gpu {
DFCCL_DAEMON_BUILD_BEGIN
namespace {

ann::Geometry GeometryOf(const AnnounceSetup& s) {
  return ann::Geometry{s.nranks, s.depth, s.entries, s.tasks, s.slots, s.slot_bytes};
}

// One thread: this rank's part of its region to its initial state (the words peers
// write are zero already: a fresh allocation, cleared), then its view.
__global__ void AnnounceInitKernel(AnnounceView* out, AnnounceView v) {
  *out = v;
  AnnouncerOf(out).Init();
}

// The members' regions as this build's transport reaches them.
void TransportOf(const AnnounceSetup& s, DaemonTransport& t) {
  t.rank = s.rank;
  t.nranks = s.nranks;
  t.dead = nullptr;  // (no liveness mask yet: a dead rank is named at the deadline, or by the host)
  t.remote = s.remote;
  t.delay_ns = s.delay_ns;
#if defined(DFCCL_DAEMON_NVSHMEM)
  t.heap = s.regions[s.rank] - s.at[s.rank];  // (the symmetric allocation, as this PE has it)
  for (int r = 0; r < s.nranks; ++r) {
    t.at[r] = s.at[r];
    t.pe[r] = s.pe[r];
  }
#else
  for (int r = 0; r < s.nranks; ++r) t.base[r] = s.regions[r];
#endif
}

#if !defined(DFCCL_DAEMON_NVSHMEM)
char* NoRegion(uint64_t, uint64_t* offset) {
  *offset = 0;
  return nullptr;
}
int32_t NoPe() { return -1; }
#endif

}  // namespace

uint64_t AnnounceRegionBytes(const AnnounceSetup& s) { return ann::Layout::Of(GeometryOf(s)).bytes; }
size_t AnnounceViewBytes() { return sizeof(AnnounceView); }

cudaError_t AnnounceInit(const AnnounceSetup& s, void* view, cudaStream_t stream) {
  if (s.nranks < 1 || s.nranks > kMaxRanks || s.rank < 0 || s.rank >= s.nranks || s.slots < 2 ||
      s.slots > ann::kMaxSlots || s.entries < 1 || s.entries > ann::kMaxEntries || s.slot_bytes % 16 != 0 ||
      s.regions[s.rank] == nullptr)
    return cudaErrorInvalidValue;
  AnnounceView v{};
  TransportOf(s, v.t);
  v.l = ann::Layout::Of(GeometryOf(s));
  v.c = ann::Config{s.group, s.timeout_ns, s.grace_ns, s.timeout_ns};
  AnnounceInitKernel<<<1, 1, 0, stream>>>(static_cast<AnnounceView*>(view), v);
  return cudaGetLastError();
}

cudaError_t AnnounceSetConfig(void* view, uint64_t timeout_ns, uint64_t grace_ns, uint64_t generation,
                              cudaStream_t stream) {
  // The daemon copies the view's Config on every pass: the next one has the new deadline.
  const uint64_t w[4] = {timeout_ns, grace_ns, timeout_ns, generation};  // timeout_ns, grace_ns, flush_ns, generation
  static_assert(offsetof(ann::Config, generation) == offsetof(ann::Config, timeout_ns) + 24, "adjacent");
  // (The view's transport derives from the engine's, DelayedTransport: not standard-layout, so
  // the Config's place is measured on an instance instead of by offsetof.)
  static const size_t config_at = [] {
    const AnnounceView probe{};
    return static_cast<size_t>(reinterpret_cast<const char*>(&probe.c) - reinterpret_cast<const char*>(&probe));
  }();
  char* dst = static_cast<char*>(view) + config_at + offsetof(ann::Config, timeout_ns);
  cudaError_t e = cudaMemcpyAsync(dst, w, sizeof(w), cudaMemcpyHostToDevice, stream);
  return e == cudaSuccess ? cudaStreamSynchronize(stream) : e;
}

#if !defined(DFCCL_DAEMON_NVSHMEM)  // (the NVSHMEM module's is in transport/nvshmem_daemon.cu)
const DaemonEngine& ThisDaemonEngine() {
  static const DaemonEngine e{"stores", &LaunchDaemon,      &AnnounceRegionBytes, &NoRegion,
                              &NoPe,    &AnnounceViewBytes, &AnnounceInit,        &AnnounceSetConfig};
  return e;
}
#endif

DFCCL_DAEMON_BUILD_END
}  // namespace dfccl::gpu
