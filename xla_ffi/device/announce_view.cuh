// A communicator matched by announcements (protocol "announce" in device/task.h,
// device/announce_path.cuh) as one rank's daemon sees it: the transport to the
// members' regions, the regions' layout, the deadlines.
#pragma once

#include "transport/announce.cuh"

namespace dfccl::gpu {

// One rank's view of a communicator matched by announcements (its device memory,
// written once by the host: AnnounceInit in device/announce_setup.cu).
struct AnnounceView {
  StoreTransport t;  // the members' regions as this GPU reaches them
  ann::Layout l;
  ann::Config c;
};
using DaemonAnnouncer = ann::Announcer<StoreTransport>;

DFCCL_DEV DaemonAnnouncer AnnouncerOf(const AnnounceView* v) {
  return DaemonAnnouncer(const_cast<StoreTransport&>(v->t), v->l, v->c);
}

}  // namespace dfccl::gpu
