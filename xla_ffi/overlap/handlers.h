// XLA FFI handlers of the fused overlap ops (CUDA; module _dfccl_overlap).
//
// dfccl_overlap_ag(x[m,K], w[K,n]) -> (out[P*m,n], xg[P*m,K] or [0,K])
//     all_gather(x, rows) @ w; xg (when not empty) receives all_gather(x).
// dfccl_overlap_rs(x[M,k], w[k,N]) -> out[M/P,N]
//     psum_scatter(x @ w, rows).
// Attributes: key (the collective key: kind, dtype, shapes), devices (i64,
// the device ordinals of every group, a row of group_size per group, in rank
// order), group_size, mode (protocol.h enum Mode: copy engine for AG rows, one
// fence per CTA in RS, copy engine for RS partials, ...).
//
// Like every collective, an instance is named (group, key, sequence): a
// channel per (device group, key), each call on a rank taking the next
// sequence number of its channel.  Every cross-rank wait is bounded by
// jax_dfccl.config.timeout_s (Configure); a failure is a dfccl::Status with
// the runtime's code and words (DEADLINE_EXCEEDED naming key, sequence and
// the ranks that never started it), kept for stats()["errors"] and raised by
// the device's next fused call and by RaiseIfFailed (docs/design/overlap.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace dfccl::overlap {

XLA_FFI_DECLARE_HANDLER_SYMBOL(OverlapAgCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OverlapRsCuda);

// The jax_dfccl.config entries the fused ops read at run time (an absent
// entry is left as it is; a value out of range throws kInvalidArgument and
// changes nothing).  No fused op runs before each was set once.
void Configure(const std::optional<double>& timeout_s, const std::optional<bool>& trace,
               const std::optional<int64_t>& trace_capacity);
struct ConfigValues {
  double timeout_s;
  bool trace;
  int64_t trace_capacity;
};
ConfigValues Config();

// What the fused ops add to the CUDA backend's stats() keys (backend.py
// merges them): instances started on this process's GPUs (one per rank and
// instance), completed, failed; instances in flight; held trace records; the
// latest error messages (newest last, at most 256); channels.
struct Stats {
  uint64_t started = 0, completed = 0, failed = 0, instances_live = 0, trace_records = 0, channels = 0;
  std::vector<std::string> errors;
};
Stats GetStats();

// (device, key, seq, event, t_ns): start (the handler enqueued it), run (its
// stream reached it), finish, error; host clock (ns since the epoch), seen
// by the host's watcher (resolution its poll period).  While config.trace.
struct TraceRecord {
  int device;
  std::string key;
  uint64_t seq;
  const char* event;
  int64_t t_ns;
};
std::vector<TraceRecord> TraceRecords();

// One line per fused instance in flight: key, sequence, rank and GPU, which
// ranks' streams reached it, whether this rank's stream did, and the ranks it
// waits for (the mailbox's per-rank ready words); failed channels with their
// error.  Each lock is tried for wait_ms only.
std::string Pending(int wait_ms);

// Throws the recorded failure of a local GPU (kept until Reset: its kernels
// trapped, the GPU's CUDA context is lost).
void RaiseIfFailed();
// Drops the recorded failures, errors and trace records (a failed channel
// keeps refusing calls: ABORTED).
void Reset();

// Diagnostics: no_comm (fused GEMM without waits or remote stores; results
// invalid) and profile (CUDA-event time of every fused GEMM kernel and side-
// stream transfer, plus the device timeline of every launch summarized per
// launch; collected and cleared by ProfileResults: (op key|gemm[_nocomm] /
// |push / |copy / |host / |tl_<what>, ms); tl_* are described at Summarize in
// handlers.cc).
void SetDiag(bool no_comm, bool profile);
std::vector<std::pair<std::string, float>> ProfileResults();

}  // namespace dfccl::overlap
