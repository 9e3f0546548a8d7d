// Runtime::Pending: a readable report of every collective in flight (who
// started it, whose stream reached it, what the daemon and the copy engines
// are doing; the fused ops' instances with the ranks each waits for), for
// `jax_dfccl.pending()` while a program seems stuck.  The runtime lock is
// tried for `wait_ms` only; device words are read on the device's private
// stream, which never waits on XLA's streams.  It reads the devices, both
// rings, the fused ops' channels and the communicators' match tables under
// the lock.
#include <cstddef>
#include <cstring>
#include <sstream>

#include "device/daemon.h"
#include "runtime/runtime.h"

namespace dfccl::gpu {
namespace {

std::string Mask(uint32_t started, int n) {
  std::string s;
  for (int r = 0; r < n; ++r) s += (started >> r) & 1 ? 'S' : '.';
  return s;
}

}  // namespace

std::string Runtime::Pending(int wait_ms) {
  std::unique_lock lk(ctx_.mu, std::chrono::milliseconds(wait_ms));
  if (!lk.owns_lock())
    return "runtime lock held for " + std::to_string(wait_ms) + " ms: a thread is blocked inside the runtime (" +
           ctx_.busy_in.load() + "; copy engine: " + ctx_.ce.Describe() + ")\n" +
           (ctx_.ipc.started() ? "IPC: " + ctx_.ipc.Describe() + "\n" : "");
  std::ostringstream os;
  const auto now = Clock::now();
  for (auto& [ord, dp] : ctx_.devices) {
    Device& d = *dp;
    DaemonPath::PerDevice& q = daemon_.Of(d);
    CopyEnginePath::PerDevice& cq = ce_path_.Of(d);
    os << "GPU " << ord << ": daemon " << (proxy_.Running(d) ? "running" : "stopped") << " (launch " << d.launch_id
       << ", " << d.workers << " workers, " << d.launches << " launches, ranges mapped before it " << d.map_gen
       << " of " << ctx_.ipc.gen() << "), tickets " << q.oldest << ".." << q.seen
       << ", copy-engine tickets " << cq.ce_oldest << ".." << cq.ce_next;
    if (!d.error.ok()) os << ", error: " << d.error.message;
    os << "\n";
    if (d.launched) {  // the daemon's own words: is its kernel alive, did it ingest, is a handoff pending
      os << "  daemon kernel " << (proxy_.Alive(d) ? "alive" : "returned") << "; host words: exiting " << d.host->exiting
         << ", resize " << d.host->resize;
      try {
        unsigned char head[offsetof(DeviceShared, pub)];  // the counters before the rings (DeviceShared's layout)
        CopyOut(d, head, d.dev, sizeof(head));
        auto word = [&](size_t offset, auto v) {
          std::memcpy(&v, head + offset, sizeof(v));
          return v;
        };
        os << "; device words: submitted " << word(offsetof(DeviceShared, submitted), uint64_t{})
           << ", complete below " << word(offsetof(DeviceShared, lo), uint64_t{})
           << ", taken " << word(offsetof(DeviceShared, next_ticket), 0ull)
           << ", quit " << word(offsetof(DeviceShared, quit), uint32_t{})
           << ", stale map " << word(offsetof(DeviceShared, stale_map), uint32_t{})
           << ", latest launch entered " << word(offsetof(DeviceShared, entered), uint32_t{})
           << ", blocks returned " << word(offsetof(DeviceShared, blocks_left), 0ull) << " of " << d.blocks_launched
           << ", progress " << word(offsetof(DeviceShared, progress), 0ull);
      } catch (const std::exception& e) {
        os << "; device words unreadable (" << e.what() << ")";
      }
      os << "\n";
    }
    daemon_.PollRecords(d, now);
    auto line = [&](const TaskInfo& ti, uint64_t t, const char* path, const std::string& key, uint32_t started, int n,
                    bool failed, int ready_state, bool done) {
      os << "  " << path << " ticket " << t << " '" << key << "' seq " << ti.seq << " " << ti.msg_bytes << " B, "
         << std::chrono::duration<double, std::milli>(now - ti.t).count() << " ms";
      if (n > 0) os << ", started " << Mask(started, n) << (failed ? ", failed" : "");
      os << ", this stream " << (ready_state < 0 ? "?" : ready_state ? "reached it" : "not there yet")
         << (done ? ", done" : "") << "\n";
    };
    // A daemon task has a record only once the submit kernel ran: XLA's stream reached it.
    for (uint64_t t = q.oldest; t < q.seen; ++t) {
      const TaskInfo& ti = q.info[t % kTaskRing];
      if (ti.done) continue;
      MatchEntry m{};
      const bool identity = ti.site && ti.site->identity;  // started: the ranks whose message arrived, and this one
      const bool found = ti.comm && !identity && daemon_.ReadEntry(*ti.comm, ti.key_hash, ti.seq, &m);
      if (identity) m.arrived = daemon_.IdentityArrived(d, ti, t) | (1u << ti.site->rank);
      line(ti, t, ti.tomb ? "tombstone (an execution left it behind)" : identity ? "daemon (by identity)" : "daemon",
           ti.site ? ti.site->key : std::to_string(ti.key_hash),
           found || identity ? m.arrived : 0, found || identity ? ti.comm->n : 0, found && m.failed != 0, 1,
           d.host->done[t % kTaskRing] == Gen(t));
      if (found && m.failed == 0 && m.slot < 0)  // arrived, waiting for a slot (device/match.cuh)
        os << "    no instance slot yet (every slot of pool " << m.pool << " in use)\n";
    }
    for (uint64_t t = cq.ce_oldest; t < cq.ce_next; ++t) {
      const TaskInfo& ti = cq.ce_info[t % kCeRing];
      if (ti.done) continue;
      const uint32_t g = Gen(t, kCeRing);
      const Instance* in = ti.inst;
      line(ti, t, "copy engine", in ? in->key : std::to_string(ti.key_hash), in ? in->started : 0, in ? in->nranks : 0,
           in && in->failed, static_cast<int32_t>(d.host->ce_ready[t % kCeRing] - g) >= 0,
           static_cast<int32_t>(d.host->ce_done[t % kCeRing] - g) >= 0);
    }
  }
  overlap_.Describe(os, now);  // the fused ops' instances in flight, with the ranks each waits for
  os << "copy engine: " << ctx_.ce.Describe() << "\n";
  if (ctx_.ipc.started()) os << "IPC: " << ctx_.ipc.Describe() << "\n";
  return os.str();
}

}  // namespace dfccl::gpu
