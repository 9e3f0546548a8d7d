// The CPU runtime's process-wide state (internal to xla_ffi/cpu: runtime.cc,
// inspect.cc).  Leaked on purpose: detached daemon threads may still run
// during process exit.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cpu/runtime.h"

namespace dfccl::cpu {

struct Globals {
  Config config;
  Counters counters;
  std::mutex comms_mu;
  std::unordered_map<std::string, std::shared_ptr<Communicator>> comms;
  std::mutex tickets_mu;
  std::unordered_map<int64_t, std::shared_ptr<Task>> tickets;
  std::atomic<int64_t> next_ticket{1};
  // Trace ring buffer: `ring` grows to `ring_cap`, then `ring_head` is the oldest.
  std::mutex trace_mu;
  std::vector<TraceRecord> ring;
  size_t ring_cap = 0, ring_head = 0;
  std::mutex errors_mu;
  std::deque<std::string> errors;  // RecordError
};

Globals& G();

}  // namespace dfccl::cpu
