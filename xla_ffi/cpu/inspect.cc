// The CPU runtime's inspection: errors, the trace ring, stats() and pending().
#include <algorithm>
#include <sstream>

#include "cpu/daemon.h"
#include "cpu/globals.h"
#include "cpu/multiprocess.h"
#include "cpu/runtime.h"

namespace dfccl::cpu {

void RecordError(const std::string& message) {
  Globals& g = G();
  std::lock_guard<std::mutex> l(g.errors_mu);
  g.errors.push_back(message);
  while (g.errors.size() > kMaxErrors) g.errors.pop_front();
}

std::vector<std::string> RecentErrors() {
  Globals& g = G();
  std::lock_guard<std::mutex> l(g.errors_mu);
  return {g.errors.begin(), g.errors.end()};
}

// ---- trace -------------------------------------------------------------------
void TraceEvent(int64_t device, const std::string& key, int64_t seq, const char* event) {
  Globals& g = G();
  if (!g.config.trace.load(std::memory_order_relaxed)) return;
  const size_t cap = static_cast<size_t>(std::max<int64_t>(1, g.config.trace_capacity.load()));
  std::lock_guard<std::mutex> l(g.trace_mu);
  const int64_t t = NowNs();  // (under the lock: the ring's order is the time order)
  if (cap != g.ring_cap) {  // capacity changed: start over
    g.ring.clear();
    g.ring.reserve(std::min<size_t>(cap, 4096));
    g.ring_cap = cap;
    g.ring_head = 0;
  }
  if (g.ring.size() < cap) {
    g.ring.push_back(TraceRecord{device, key, seq, event, t});
  } else {
    g.ring[g.ring_head] = TraceRecord{device, key, seq, event, t};
    g.ring_head = (g.ring_head + 1) % cap;
  }
}

std::vector<TraceRecord> TraceSnapshot() {
  Globals& g = G();
  std::lock_guard<std::mutex> l(g.trace_mu);
  std::vector<TraceRecord> out;
  out.reserve(g.ring.size());
  for (size_t i = 0; i < g.ring.size(); ++i) out.push_back(g.ring[(g.ring_head + i) % g.ring.size()]);
  return out;
}

int64_t TraceSize() {
  Globals& g = G();
  std::lock_guard<std::mutex> l(g.trace_mu);
  return static_cast<int64_t>(g.ring.size());
}

// ---- module functions ---------------------------------------------------------------
StatsSnapshot GetStats() {
  Globals& g = G();
  StatsSnapshot s{};
  s.started = g.counters.started.load();
  s.completed = g.counters.completed.load();
  s.failed = g.counters.failed.load();
  s.preemptions = g.counters.preemptions.load();
  s.resumes = g.counters.resumes.load();
  s.pending = g.counters.live_tasks.load();
  s.daemon_threads = NumDaemons();
  std::vector<std::shared_ptr<Communicator>> comms;
  {
    std::lock_guard<std::mutex> l(g.comms_mu);
    for (auto& [name, c] : g.comms) comms.push_back(c);
  }
  s.communicators = static_cast<int64_t>(comms.size());
  for (auto& c : comms) {
    std::lock_guard<std::mutex> l(c->mu);
    s.instances_live += static_cast<int64_t>(c->instances.size());
    s.key_counters += static_cast<int64_t>(c->counters.size());
    for (auto& [k, per_key] : c->tombstones) s.tombstones += static_cast<int64_t>(per_key.size());
  }
  s.trace_records = TraceSize();
  {
    std::lock_guard<std::mutex> l(g.tickets_mu);
    s.tickets = static_cast<int64_t>(g.tickets.size());
  }
  const StagingStats st = GetStagingStats();
  s.staging_bytes = st.in_use_bytes;
  s.staging_pool_bytes = st.retained_bytes;
  return s;
}

std::string PendingReport() {
  Globals& g = G();
  std::vector<std::shared_ptr<Communicator>> comms;
  {
    std::lock_guard<std::mutex> l(g.comms_mu);
    for (auto& [name, c] : g.comms) comms.push_back(c);
  }
  const int64_t now = NowNs();
  std::vector<std::string> lines;
  for (auto& c : comms) {
    std::lock_guard<std::mutex> l(c->mu);
    for (auto& [k, inst] : c->instances) {
      std::ostringstream os, in, out;
      int64_t first = now;
      for (int r = 0; r < inst->n; ++r) {
        const Slot& s = inst->slots[r];
        std::ostream& o = s.posted ? in : out;
        o << (o.tellp() > 0 ? ", " : "") << r << " (device " << c->devices[r] << ")";
        if (s.posted && s.task) first = std::min(first, s.task->start_ns);
      }
      os << "group " << c->name << ": '" << inst->key << "' seq " << inst->seq << ", started by rank(s) ["
         << in.str() << "]";
      if (out.tellp() > 0) os << ", not by [" << out.str() << "]";
      os << ", first start " << (now - first) / 1000000 << " ms ago";
      if (inst->failed.load()) os << ", failed: " << inst->error;
      lines.push_back(os.str());
    }
  }
  std::sort(lines.begin(), lines.end());
  std::string report;
  for (const std::string& line : lines) report += line + "\n";
  return report + ShmPendingReport();
}

}  // namespace dfccl::cpu
