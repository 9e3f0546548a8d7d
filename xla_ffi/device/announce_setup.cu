// The host's side of protocol "announce" (device/task.h, device/announce_path.cuh):
// a rank's region size for a geometry, and its region's initial state with its
// view (the members' regions, the layout, the deadlines) written to the device.
#include <cstddef>

#include "device/announce_view.cuh"
#include "device/daemon.h"

namespace dfccl::gpu {
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

}  // namespace

uint64_t AnnounceRegionBytes(const AnnounceSetup& s) { return ann::Layout::Of(GeometryOf(s)).bytes; }
size_t AnnounceViewBytes() { return sizeof(AnnounceView); }

cudaError_t AnnounceInit(const AnnounceSetup& s, void* view, cudaStream_t stream) {
  if (s.nranks < 1 || s.nranks > kMaxRanks || s.rank < 0 || s.rank >= s.nranks || s.slots < 2 ||
      s.slots > ann::kMaxSlots || s.slot_bytes % 16 != 0)
    return cudaErrorInvalidValue;
  AnnounceView v{};
  v.t.rank = s.rank;
  v.t.nranks = s.nranks;
  for (int r = 0; r < s.nranks; ++r) v.t.base[r] = s.regions[r];
  v.t.dead = nullptr;  // (no liveness mask yet: a dead rank is named at the deadline, or by the host)
  v.l = ann::Layout::Of(GeometryOf(s));
  v.c = ann::Config{s.group, s.timeout_ns, s.grace_ns, s.timeout_ns};
  AnnounceInitKernel<<<1, 1, 0, stream>>>(static_cast<AnnounceView*>(view), v);
  return cudaGetLastError();
}

cudaError_t AnnounceSetTimeout(void* view, uint64_t timeout_ns, uint64_t grace_ns, cudaStream_t stream) {
  // The daemon copies the view's Config on every pass: the next one has the new deadline.
  const uint64_t w[3] = {timeout_ns, grace_ns, timeout_ns};  // timeout_ns, grace_ns, flush_ns
  static_assert(offsetof(ann::Config, flush_ns) == offsetof(ann::Config, timeout_ns) + 16, "deadlines adjacent");
  char* dst = static_cast<char*>(view) + offsetof(AnnounceView, c) + offsetof(ann::Config, timeout_ns);
  cudaError_t e = cudaMemcpyAsync(dst, w, sizeof(w), cudaMemcpyHostToDevice, stream);
  return e == cudaSuccess ? cudaStreamSynchronize(stream) : e;
}

}  // namespace dfccl::gpu
