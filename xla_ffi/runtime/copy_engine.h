// Large collectives on the GPUs' copy engines, driven by a host thread (the
// mover).  Once every rank has started an instance (host-side matching, as for
// the daemon) the instance is submitted here and the mover enqueues the whole
// collective on per-device side streams: each rank's engines *push* its data
// into the peers' buffers over NVLink (or *pull* what it needs from them;
// cudaMemcpyAsync, UVA peer access), a small combine kernel folds arrived
// chunks into the output (reductions), and each rank's *done* word is written
// once every peer finished with its buffers (cross-device events).  No SMs are
// held (the combine kernel runs briefly).
//
// Nothing is enqueued before every rank's *ready* word is set (host-mapped,
// written by the XLA streams, polled by the mover), so the side streams never
// wait on an XLA stream: instances complete in any order and the path stays
// deadlock-free.  (Enqueueing ahead, behind a wait for the ready words on the
// side streams, deadlocked on 2xH200: a side stream's wait can share a hardware
// queue with the XLA work it waits for.)
//
//   ALL_GATHER, ALL_TO_ALL, PPERMUTE   any group size: transfers, plus a local copy
//   REDUCE_SCATTER, ALL_REDUCE         2 ranks (one peer operand per element;
//                                      all-reduce: reduce-scatter, then each
//                                      rank's reduced half to the peer)
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dfccl/collective.h"

namespace dfccl::gpu {

struct CeRank {
  int ordinal = 0;
  const char* in = nullptr;
  char* out = nullptr;
  int32_t recv_from = -1;                    // PPERMUTE
  const volatile uint32_t* ready = nullptr;  // host address, written by XLA's stream
  uint32_t* done = nullptr;                  // device address of the host-mapped done word
  volatile uint32_t* done_host = nullptr;    // ... its host address (a failed issue releases the ranks)
  uint32_t gen = 0;                          // value of both words for this instance
};

struct CeOp {
  const void* comm = nullptr;  // identity, for Cancel
  uint64_t key_hash = 0, seq = 0;
  OpKind kind = OpKind::kAllGather;
  ReduceOp reduce = ReduceOp::kSum;
  DType dtype = DType::kF32;
  int64_t elem_bytes = 0, elems = 0;  // E of collective.h's canonical layout
  std::vector<CeRank> ranks;
};

struct CeSettings {
  int64_t chunk_bytes = 8 << 20;  // pipelining unit of the reductions (at most kMaxChunks per rank)
  int reduce_blocks = 32;         // blocks of the combine kernel
  bool push = true;               // a rank's copies write into its peers' buffers (else read from them)
};

class CopyEngine {
 public:
  static constexpr int kMaxChunks = 16;
  // The ops with a copy-engine plan (CopyEngine::Issue); reductions on 2 GPUs only.
  static bool Supports(OpKind kind, int nranks) {
    switch (kind) {
      case OpKind::kAllReduce: case OpKind::kReduceScatter: return nranks == 2;
      case OpKind::kAllGather: case OpKind::kAllToAll: case OpKind::kPermute: return true;
      default: return false;  // broadcast, ragged_all_to_all: the daemon kernel
    }
  }

  ~CopyEngine() { Stop(); }
  // Creates a device's side streams and events (the runtime's device setup).
  void Prepare(int ordinal);
  void Configure(const CeSettings& s) { std::lock_guard<std::mutex> lk(mu_); settings_ = s; }
  // Every rank has started `op`; it is issued once every rank's ready word is set.
  void Submit(CeOp op);
  // Drops `op` if it was not enqueued yet (true); false once its copies are enqueued.
  bool Cancel(const void* comm, uint64_t key_hash, uint64_t seq);
  bool Pending(const void* comm, uint64_t key_hash, uint64_t seq);  // submitted, not issued yet
  int64_t issued() const { return issued_; }
  // Totals: host time enqueueing instances (all ranks), and GPU time of rank 0's
  // part from its first copy to its done write over the `timed` instances.
  double issue_s() const { return issue_ns_ / 1e9; }
  double gpu_s() const { return gpu_ns_ / 1e9; }
  int64_t timed() const { return timed_; }
  std::string error();  // the first CUDA failure of the mover, "" if none
  // What the mover is doing and the instances it holds (never blocks for long).
  std::string Describe();
  void Stop();

 private:
  struct Dev {
    cudaStream_t pull = nullptr, pull2 = nullptr, comp = nullptr;
    cudaEvent_t pulled[kMaxChunks]{}, reduced[kMaxChunks]{}, joined = nullptr, fin = nullptr;
    static constexpr int kTimers = 32;
    cudaEvent_t t0[kTimers]{}, t1[kTimers]{};  // timing events, used round-robin
    int timer_head = 0;
    std::deque<int> timing;                    // timers recorded, not yet read
  };
  enum Phase { kNotStarted, kSleeping, kPolling, kTimers, kIssuing };
  void Loop();
  static bool Ready(const CeOp& op);
  void Issue(const CeOp& op, const CeSettings& s);
  void ReadTimers();
  Dev& GetDev(int ordinal);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<CeOp> pending_;
  CeSettings settings_;
  std::mutex devs_mu_;
  std::map<int, Dev> devs_;  // created by Prepare, used by the mover
  std::thread thread_;
  bool stop_ = false;
  std::string error_;
  std::atomic<int64_t> issued_{0}, issue_ns_{0}, gpu_ns_{0}, timed_{0};
  std::atomic<int> phase_{0};               // Phase: what the mover does now (Describe)
  std::atomic<uint64_t> phase_key_{0}, phase_seq_{0};
};

}  // namespace dfccl::gpu
