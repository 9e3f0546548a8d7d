// The fused-op path (the dfccl_overlap_* targets, ffi/overlap_handlers.cc): a
// fused GEMM+communication op is a collective of the communicator of its group
// (Context::GetComm), named (group, key, sequence) like the others.  Its
// kernels (overlap/) synchronize the ranks among themselves through a
// host-mapped mailbox and persistent buffers per (communicator, key): a
// channel.  A handler never blocks on another device: it enqueues (ready
// write, kernels, done write) and returns; every cross-rank wait happens in the
// kernels, bounded by config.timeout_s (overlap/protocol.h).  The proxy
// (proxy.h) polls the channels (Poll) like its ticket rings: completions (the
// ranks' done words), the instances whose stream reached them (ready words),
// and the deadline, at which an instance fails through Communicator::Fail with
// the runtime's code and words (DEADLINE_EXCEEDED naming key, sequence and the
// ranks that never started it).  Counts go to Device (fused_started,
// completed, failed), trace records to Context::host_trace, messages to
// Context::errors; Runtime's stats(), trace() and pending() read them.
//
// Owns: the channels (mailbox, done words, per local rank its persistent
// buffers, flags, counters and instances in flight) and per device the side
// stream of the AG pushes.  Not command-buffer compatible (host work and a
// private side stream).
// Lock: everything under Context::mu (Begin, Commit and Device take it
// themselves, and drop it before any enqueue on XLA's stream and around a
// device's kernel loading).  A RankState's
// buffers and launch counters (rs_ce_rounds, tiles_taken, sk_*) are used by
// its device's handler only, outside the lock; its flights only under it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "overlap/protocol.h"
#include "runtime/context.h"

namespace dfccl::gpu {

class OverlapPath {
 public:
  static constexpr int kMaxRanks = overlap::kMaxRanks;

  // One instance on one local rank, from its handler call to its completion
  // (its done word) or failure.
  struct Flight {
    uint32_t seq = 0;
    Clock::time_point called;   // the handler enqueued it
    Clock::time_point reached;  // its stream reached it (ready word seen by the host)
    bool has_reached = false;
  };

  // A local rank of a channel.
  struct RankState {
    bool init = false;
    int ordinal = -1;
    void* buf = nullptr;        // AG: gather [P][m][K]; RS: recv [P][M/P][N]
    uint32_t* flags = nullptr;  // AG: [P][m tiles]; RS: [P][tiles of a row block]
    uint32_t* counter = nullptr;  // [0]: GEMM tile counter; AG: then [P-1][m tiles] push counters;
                                  // RS: [1] done counter of the peer block's tiles (copy engine)
    uint32_t* ready_in = nullptr;  // [kMaxRanks]: the peers' announcements (protocol.h)
    uint32_t seq = 0;  // the sequence number of this rank's latest instance of the (group, key)
    uint32_t rs_ce_rounds = 0;  // RS copy-engine launches so far (done counter target / tiles)
    uint32_t tiles_taken = 0;   // GEMM tile counter value after all launches so far
    float* sk_partials = nullptr;  // split last wave: [SMs][kTileM * kTileNMax] f32 (at its first use)
    uint32_t* sk_flags = nullptr;  // split last wave: [SMs] instance numbers
    std::deque<Flight> flights;    // instances in flight, oldest first
  };

  // The instances of one key on one communicator, with their mailbox.
  struct Channel {
    Communicator* comm = nullptr;
    uint64_t key_hash = 0;
    std::string key;
    int kind = 0;  // overlap::Kind
    int nranks = 0;
    size_t buf_bytes = 0;                // of the first call (the key names the shapes and dtype)
    overlap::Mailbox* mbox = nullptr;    // host-mapped, portable
    uint32_t* done = nullptr;            // host-mapped [kMaxRanks]: rank p's stream wrote seq after instance seq
    bool failed = false;                 // an instance timed out (the kernels trapped): no further call runs
    uint32_t failed_seq = 0;
    std::string error;
    RankState ranks[kMaxRanks];
  };

  // Per device: the side stream of the AG pushes and copy-engine transfers.
  struct PerDevice {
    cudaStream_t side = nullptr;
    cudaEvent_t start = nullptr, done = nullptr;
    int sms = 0;
    int cluster_ctas = 0;  // CTAs of the 2x1-cluster GEMM resident at once (both dtypes)
  };
  using DeviceInit = void (*)(PerDevice&);  // the kernels' part of a device's set-up (the handlers')

  // What a handler's call gets from Begin: its channel, rank, sequence number,
  // the wait bound of its kernels and the peers' addresses known here (0: a
  // peer not initialized yet).
  struct Call {
    Channel* c = nullptr;
    RankState* rs = nullptr;
    int ordinal = -1, rank = -1;
    uint32_t seq = 0;
    int64_t timeout_ns = 0;
    uint64_t peer_buf[kMaxRanks] = {}, peer_flags[kMaxRanks] = {}, peer_ready[kMaxRanks] = {};
  };

  explicit OverlapPath(Context& ctx) : ctx_(ctx) {}

  // Handlers.  Throw dfccl::Error (the FFI boundary, ffi/error.h, converts it).
  void ThrowIfFailed(int ordinal);  // the device's recorded failure
  PerDevice& Device(int ordinal, DeviceInit init);
  // The instance's start: channel and rank state (the first call's buffers),
  // its sequence number, then (outside the lock) the ready write on `stream`.
  Call Begin(cudaStream_t stream, int ordinal, std::string_view key, int kind, const std::vector<int>& devs, int rank,
             size_t buf_bytes, size_t flag_words, size_t counter_words);
  // The instance is enqueued: counted as started, in flight until its done word.
  void Commit(cudaStream_t stream, const Call& call);

  // Under Context::mu: the proxy's round, and what stats(), pending() read.
  void Poll(Clock::time_point now);
  bool Busy() const;
  size_t Live() const;
  size_t channels() const { return channels_.size(); }
  void Describe(std::ostream& os, Clock::time_point now);

 private:
  Channel& GetChannel(Communicator& comm, std::string_view key, int kind);
  void InitRank(Channel& c, int rank, size_t buf_bytes, size_t flag_words, size_t counter_words);
  void PollChannel(Channel& c, Clock::time_point now);
  void Fail(Channel& c, uint32_t seq, uint32_t kernel_code);
  std::vector<int> Missing(const Channel& c, uint32_t seq) const;
  std::string RankList(const Channel& c, const std::vector<int>& ranks) const;
  void Trace(const Channel& c, int ordinal, uint64_t seq, const char* event);

  Context& ctx_;
  std::map<std::pair<Communicator*, uint64_t>, std::unique_ptr<Channel>> channels_;  // by (comm, key_hash)
  std::map<int, PerDevice> devices_;  // by ordinal
};

}  // namespace dfccl::gpu
