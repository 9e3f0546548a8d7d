// The copy-engine path (the *_host targets): matched on the host (Join, over
// the communicator's live instances), moved by the mover thread
// (runtime/copy_engine.h); on XLA's stream a ready write and a done wait per
// rank (stream memory operations).  The proxy (proxy.h) polls its ticket ring
// and calls back here when a ticket completes (OnTaskDone) or times out (Abort).
//
// Owns: per device (PerDevice) the copy-engine ticket ring as the host sees it
// and the start/done pairing per call site; its sequence counters live in the
// Communicator, its instances in Communicator::live.
// Lock: everything under Context::mu, except EnqueueOnStream, which runs
// outside it (an enqueue on XLA's stream may block while its queue is full).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <unordered_map>

#include "dfccl/collective.h"
#include "runtime/context.h"

namespace dfccl::gpu {

class CopyEnginePath {
 public:
  // The copy-engine path's state of one device.
  struct PerDevice {
    std::array<TaskInfo, kCeRing> ce_info;  // copy-engine collectives (tickets ce_oldest .. ce_next)
    uint64_t ce_next = 0, ce_oldest = 0;
    std::unordered_map<int64_t, std::deque<uint64_t>> fifo;  // start/done pairing per site
  };

  explicit CopyEnginePath(Context& ctx) : ctx_(ctx) {}
  // Handlers.  Throw dfccl::Error (the FFI boundary, ffi/error.h, converts it).
  void StartHost(int ordinal, cudaStream_t stream, const CollectiveSpec& spec, const std::string& signature,
                 const void* in, void* out, bool blocking);
  void DoneHost(int ordinal, cudaStream_t stream, int64_t site);
  // Whether a collective of these sizes takes this path (under Context::mu).
  bool UseCopyEngine(OpKind kind, int nranks, int64_t bytes) const;

  // Under Context::mu.
  PerDevice& Of(const Device& d) { return devices_[d.ordinal]; }
  void OnTaskDone(Device& d, TaskInfo& ti);
  void Abort(Communicator& c, Instance& inst, ErrorCode code, const std::string& why);

 private:
  // What a handler enqueues on XLA's stream for one instance.
  struct Enqueue {  // a copy-engine ticket's words on XLA's stream
    Device* d = nullptr;
    uint64_t ticket = 0;  // without kCeTicket
  };
  uint64_t SubmitCe(Device& d, const CollectiveSpec& spec, const std::string& sig, const void* in, void* out);
  void EnqueueOnStream(cudaStream_t stream, const Enqueue& e, bool ready, bool wait);
  Instance* Join(Communicator& c, const CollectiveSpec& spec, const std::string& sig, uint64_t seq);
  void StartCopyEngine(Device& d, Communicator& c, Instance& inst, const CollectiveSpec& spec, const void* in,
                       void* out, uint64_t ticket);

  Context& ctx_;
  std::map<int, PerDevice> devices_;  // by ordinal
};

}  // namespace dfccl::gpu
