// The submit kernels' side of the execution book (protocol "run" in
// xla_ffi/device/task.h): xla_ffi/device/submit.cuh's SubmitTake, SubmitBook and
// the tombstones it submits, compiled for the host (tests/cpp/device_shim) and run
// as one GPU's stream would run its submit kernels, against the host's side
// (xla_ffi/runtime/run_book.h) opening the lines as the initialize stage does.
// Checks what lands in the device's ring: which sequence numbers the tombstones
// and the start take, that tombstones carry no buffers and arrive failed, the
// host's records, the launch id of a start replayed from a command buffer (the
// initialize stage's word), what the host found owed, and the cap on the
// tombstones of one start.  Built and run by tests/cpp/test_cpu_runtime.py under
// ASan and UBSan.
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "check.h"
#include "device/submit.cuh"
#include "runtime/run_book.h"

using namespace dfccl::gpu;

namespace {

// What one submit kernel left in the ring: its task and its tombstones, in ticket order.
struct Published {
  uint64_t seq;
  bool tomb;
  uint32_t run;
  uint32_t invalid;
  const char* in;
  bool host_tomb;  // the host's record says tombstone (kTombSite)
};

// One GPU's stream of submit kernels of one identity call site (no match table:
// the identity path publishes without arriving anywhere).
struct Stream {
  std::unique_ptr<DeviceShared> dev = std::make_unique<DeviceShared>();
  std::unique_ptr<HostShared> host = std::make_unique<HostShared>();
  RunBook book;
  RunSlots slots{kRunSlots};
  uint64_t read = 0;  // tickets already returned by Submit
  char buf[64] = {};

  Stream() {
    std::memset(static_cast<void*>(dev.get()), 0, sizeof(DeviceShared));
    std::memset(static_cast<void*>(host.get()), 0, sizeof(HostShared));
  }
  // XLA's initialize stage (daemon_path.cc Plan): the program's line opened, its call site.
  int Plan(uint32_t run) {
    const RunBook::Change ch = book.Plan(run, 7, &slots);
    if (ch.open) {
      dev->run_slot[ch.slot] = ch.init;
      dev->run_owed[ch.slot] = 0;
    } else if (ch.sites) {
      dev->run_slot[ch.slot].line.sites = ch.init.line.sites;
    }
    return ch.slot;
  }
  // XLA's initialize stage: the execution's launch id on the stream.
  void Begin(uint32_t run) { dev->run_word = run; }
  // One start (the submit kernel's steps, device/submit_kernel.cu): `run` is the
  // handler's launch id, 0 for a start replayed from a command buffer.
  std::vector<Published> Submit(uint32_t handler_run, int line) {
    SubmitParams p{};
    p.task.key_hash = 0x1234;
    p.task.kind = 0;
    p.task.pool = 0;
    p.task.lanes = 1;
    p.task.rank = 1;
    p.task.nranks = 2;
    p.task.match = kMatchIdentity;
    p.task.slot = 0;
    p.task.key_ctr = 3;
    p.task.vec = 1;
    p.dev = dev.get();
    p.host = host.get();
    p.in = buf;
    p.out = buf + 16;
    p.site = 5;
    p.timeout_ns = 1000000000;
    p.run = handler_run;
    p.book = line + 1;
    TaskDesc d;
    SubmitTake(p, d);  // (then the line, after the dependency wait, as the kernels do)
    const bool behind = p.book > 0 && SubmitBook(p, d, SubmitBookRead(p));
    if (behind) d.invalid = PackStatus(kStatusLeftBehind, d.rank, d.rank);
    SubmitMatch(p, d);
    SubmitPublish(p, d);
    std::vector<Published> out;
    for (; read < dev->next_ticket; ++read) {
      const uint32_t e = read % kTaskRing;
      const TaskDesc& t = dev->desc[e];
      out.push_back(Published{t.seq, t.tomb != 0, t.run, t.invalid, t.in, (host->sub[e].site & kTombSite) != 0});
      dev->done[e] = Gen(read);  // the daemon completes it (the ring entry can be reused)
    }
    return out;
  }
};

}  // namespace

int main() {
  {  // execution 101 fails before its two starts: 102's first start submits two tombstones
    Stream s;
    const int line = s.Plan(100);
    s.Begin(100);
    Expect(s.Submit(100, line).size() == 1 && s.Submit(100, line).size() == 1, "a start publishes one task");
    s.Plan(101);
    s.Begin(101);  // (it fails before its starts)
    s.Plan(102);
    s.Begin(102);
    const std::vector<Published> p = s.Submit(102, line);
    Expect(p.size() == 3, "two tombstones and the start");
    if (p.size() == 3) {
      Expect(p[0].seq == 2 && p[1].seq == 3 && p[2].seq == 4, "the tombstones take the left-behind numbers, the start the next");
      Expect(p[0].tomb && p[1].tomb && !p[2].tomb, "tombstones first");
      Expect(p[0].host_tomb && p[1].host_tomb && !p[2].host_tomb, "the host's records say which are tombstones");
      Expect(p[0].in == nullptr && p[1].in == nullptr && p[2].in == s.buf, "tombstones carry no buffers");
      Expect(p[0].invalid == PackStatus(kStatusLeftBehind, 1, 1) && p[2].invalid == 0, "a tombstone arrives failed");
      Expect(p[0].run == 0 && p[2].run == 102, "the start carries its launch id, a tombstone none");
    }
    const std::vector<Published> q = s.Submit(102, line);
    Expect(q.size() == 1 && q[0].seq == 5 && !q[0].tomb, "the execution's next start submits none");
  }
  {  // inside a command buffer: the replayed kernel's launch id is the initialize stage's word
    Stream s;
    const int line = s.Plan(500);
    s.Begin(500);
    s.Submit(500, line);  // recorded: the handler's id
    for (uint32_t run = 501; run <= 504; ++run) {
      s.Plan(run);
      s.Begin(run);
      if (run == 502) continue;  // failed before the start
      const std::vector<Published> p = s.Submit(0, line);  // replayed: no handler
      Expect(!p.empty() && p.back().run == run, "a replayed start carries its execution's launch id");
      Expect(p.size() == (run == 503 ? 2u : 1u), "the replay after a failed execution submits its tombstone");
    }
  }
  {  // the host found one more owed (a start that was ahead): the next start skips it too
    Stream s;
    const int line = s.Plan(10);
    s.Begin(10);
    s.Submit(10, line);
    s.dev->run_owed[line] = 1;  // (daemon_path.cc OnDaemonTaskDone, kStatusLeftBehind of its own rank)
    s.Plan(11);
    s.Begin(11);
    const std::vector<Published> p = s.Submit(11, line);
    Expect(p.size() == 2 && p[0].tomb && p[1].seq == 2, "an owed start becomes a tombstone");
    Expect(s.Submit(11, line).size() == 1, "owed once");
  }
  {  // more left behind than one start submits: the rest stays owed, this start fails
    Stream s;
    const int line = s.Plan(1000);
    s.Begin(1000);
    s.Submit(1000, line);
    const uint32_t later = 1000 + kMaxTombstones + 2;  // kMaxTombstones + 1 executions left behind
    s.Plan(later);
    s.Begin(later);
    const std::vector<Published> p = s.Submit(later, line);
    Expect(p.size() == static_cast<size_t>(kMaxTombstones) + 1, "at most kMaxTombstones before one start");
    Expect(!p.empty() && !p.back().tomb && p.back().invalid == PackStatus(kStatusLeftBehind, 1, 1),
           "the start behind them fails");
    const std::vector<Published> q = s.Submit(later, line);
    Expect(q.size() == 2 && q[0].tomb && q[1].invalid == 0, "the rest on the next start, which then pairs");
  }
  {  // a start of a group inside one process (no line): no book, nothing but its task
    Stream s;
    const std::vector<Published> p = s.Submit(77, -1);
    Expect(p.size() == 1 && p[0].seq == 0 && p[0].run == 77, "no line, no tombstones");
  }
  if (Failures()) return 1;
  std::printf("OK\n");
  return 0;
}
