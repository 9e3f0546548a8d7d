// A communicator matched by announcements (protocol "announce" in device/task.h,
// device/announce_path.cuh) as one rank's daemon sees it: the transport to the
// members' regions, the regions' layout, the deadlines.
//
// The transport is the daemon build's (device/daemon.h, DaemonEngine): direct
// stores through NVLink peer access or CUDA IPC in _dfccl_cuda; NVSHMEM where the
// daemon is compiled into _dfccl_nvshmem (DFCCL_DAEMON_NVSHMEM).  The host never
// reads a view: it has the engine write one (DaemonEngine::announce_init).
#pragma once

#include "transport/announce.cuh"
#if defined(DFCCL_DAEMON_NVSHMEM)
#include "transport/nvshmem.cuh"
#endif

namespace dfccl::gpu {

// (Delayed: the latency of another host simulated, a test setting; none by default.)
#if defined(DFCCL_DAEMON_NVSHMEM)
using DaemonTransport = DelayedTransport<NvshmemTransport>;
#else
using DaemonTransport = DelayedTransport<StoreTransport>;
#endif

// One rank's view of a communicator matched by announcements (its device memory,
// written once by the host: AnnounceInit in device/announce_setup.cu).
struct AnnounceView {
  DaemonTransport t;  // the members' regions as this GPU reaches them
  ann::Layout l;
  ann::Config c;
};
using DaemonAnnouncer = ann::Announcer<DaemonTransport>;

// (`own`: the rank's own state where the daemon keeps it, AnnounceCache; null: its region.)
DFCCL_DEV DaemonAnnouncer AnnouncerOf(const AnnounceView* v, char* own = nullptr) {
  return DaemonAnnouncer(const_cast<DaemonTransport&>(v->t), v->l, v->c, own);
}

}  // namespace dfccl::gpu
