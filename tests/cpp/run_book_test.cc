// The GPU runtime's execution book (protocol "run" in xla_ffi/device/task.h): the
// host's side (xla_ffi/runtime/run_book.h: which program an execution belongs to,
// its line on the device, its call sites, what is owed) together with the
// arithmetic the submit kernels run on the device's lines (dfccl/execution.h
// RunSlotStart), on a table of lines in host memory: how many starts of a key the
// earlier executions of a program left behind, from the launch ids of its starts
// (built and run by tests/cpp/test_cpu_runtime.py under ASan and UBSan).
#include <cstdio>
#include <vector>

#include "check.h"
#include "runtime/run_book.h"

using dfccl::RunSlot;
using dfccl::gpu::RunBook;
using dfccl::gpu::RunSlots;

namespace {

// One key's book on one device: the host's RunBook and the device's lines, as
// daemon_path.cc (Plan, Owe) and device/submit.cuh (SubmitBook) use them.
struct Device {
  explicit Device(int lines = 64) : slots(lines), line(lines), owed(lines) {}
  RunBook book;
  RunSlots slots;
  std::vector<RunSlot> line;
  std::vector<int64_t> owed;  // DeviceShared::run_owed

  // XLA's initialize stage of call site `site` in execution `run`.
  void Plan(uint32_t run, int64_t site = 7) {
    const RunBook::Change ch = book.Plan(run, site, &slots);
    slots.Give(ch.freed);
    if (ch.open) {
      line[ch.slot] = ch.init;
      owed[ch.slot] = 0;
    } else if (ch.sites) {
      line[ch.slot].line.sites = ch.init.line.sites;
    }
  }
  // A start in execution `run` (its handler finds the line; a replay from a
  // command buffer names the same line): the tombstones the device submits.
  int64_t Start(uint32_t run) {
    const int s = book.SlotOf(run);
    return s < 0 ? 0 : dfccl::RunSlotStart(line[s], owed[s], run);
  }
  void Owe(int64_t n) {
    const auto [s, total] = book.Owe(n);
    if (s >= 0) owed[s] = total;
  }
  // An execution: its initialize stage (one call site), then `starts` starts.
  std::vector<int64_t> Exec(uint32_t run, int starts) {
    Plan(run);
    std::vector<int64_t> out;
    for (int i = 0; i < starts; ++i) out.push_back(Start(run));
    return out;
  }
};

using V = std::vector<int64_t>;

V Cat(std::initializer_list<V> parts) {
  V out;
  for (const V& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

}  // namespace

int main() {
  {  // three starts an execution; no failure: nothing to skip
    Device d;
    Expect(Cat({d.Exec(100, 3), d.Exec(101, 3), d.Exec(102, 3)}) == V(9, 0), "a steady program skips nothing");
  }
  {  // execution 101 failed before its first start: 102's first start skips its three
    Device d;
    Expect(Cat({d.Exec(100, 3), d.Exec(101, 0), d.Exec(102, 3)}) == V({0, 0, 0, 3, 0, 0}),
           "a whole execution left behind");
  }
  {  // execution 101 failed after one of its three starts
    Device d;
    Expect(Cat({d.Exec(100, 3), d.Exec(101, 1), d.Exec(102, 3)}) == V({0, 0, 0, 0, 2, 0, 0}),
           "an execution's tail left behind");
  }
  {  // two executions failed in a row (one with its initialize stage, one without)
    Device d;
    Expect(Cat({d.Exec(100, 2), d.Exec(101, 0), d.Exec(103, 2)}) == V({0, 0, 4, 0}), "two executions left behind");
  }
  {  // another program's starts of the key in between (MPMD or a second jitted function)
    Device d;
    Expect(Cat({d.Exec(100, 2), d.Exec(900000, 1), d.Exec(101, 2), d.Exec(900001, 1), d.Exec(102, 0),
                d.Exec(103, 2)}) == V({0, 0, 0, 0, 0, 0, 2, 0}),
           "programs are booked apart");
  }
  {  // across the 32-bit wrap of launch ids
    Device d;
    Expect(Cat({d.Exec(0xfffffffeu, 2), d.Exec(0xffffffffu, 2), d.Exec(0u, 0), d.Exec(1u, 2)}) ==
               V({0, 0, 0, 0, 2, 0}),
           "the wrap of launch ids");
  }
  {  // an execution that starts the key fewer times than the most (a data-dependent loop): every
    // process pads it alike, so the processes stay aligned where none failed
    Device a, b;
    auto history = [](Device& d) { return Cat({d.Exec(100, 3), d.Exec(101, 1), d.Exec(102, 3)}); };
    const V ta = history(a);
    Expect(ta == history(b), "processes with one history skip alike");
    Expect(ta == V({0, 0, 0, 0, 2, 0, 0}), "a short execution is padded to the program's most");
  }
  {  // process 0 failed before the key in execution 101; process 1 ran it whole:
    // process 0's tombstones take exactly the sequence numbers process 1's 101 took
    Device p0, p1;
    const V t0 = Cat({p0.Exec(100, 2), p0.Exec(101, 0), p0.Exec(102, 2)});
    const V t1 = Cat({p1.Exec(100, 2), p1.Exec(101, 2), p1.Exec(102, 2)});
    auto seqs = [](const V& tombs) {  // sequence numbers of the real starts
      std::vector<int64_t> s;
      int64_t next = 0;
      for (int64_t t : tombs) { next += t; s.push_back(next++); }
      return s;
    };
    const std::vector<int64_t> s0 = seqs(t0), s1 = seqs(t1);
    Expect(s0[2] == s1[4] && s0[3] == s1[5], "the processes' execution 102 takes the same sequence numbers");
  }
  {  // more programs than the book keeps: the oldest goes (its line is reused), the others stay exact
    Device d(static_cast<int>(RunBook::kPrograms));
    for (uint32_t p = 0; p < RunBook::kPrograms + 4; ++p) d.Exec(1000000u * (p + 1), 1);
    const uint32_t last = 1000000u * (RunBook::kPrograms + 4);
    d.Plan(last + 1);
    d.Plan(last + 2);
    Expect(d.Start(last + 2) == 1, "the latest program is still booked");
    Expect(d.book.SlotOf(1000000u) < 0, "the oldest program is forgotten");
  }
  {  // a program's first execution fails before its one start: the retry skips it
    Device d;
    d.Plan(100);
    d.Plan(101);
    Expect(d.Start(101) == 1 && d.Start(102) == 0, "a first execution left behind");
  }
  {  // three starts an execution (a loop); execution 101 fails before the loop
    Device d;
    d.Exec(100, 3);
    d.Plan(101);
    d.Plan(102);
    Expect(d.Start(102) == 3 && d.Start(102) == 0, "a loop's execution left behind");
  }
  {  // two call sites of the key; the first execution fails before both
    Device d;
    d.Plan(100, 1);
    d.Plan(100, 2);
    d.Plan(101, 1);
    d.Plan(101, 2);
    Expect(d.Start(101) == 2, "one start per call site of a first execution");
  }
  {  // the device found a start ahead of its peers (Owe): the next start skips one more
    Device d;
    d.Exec(100, 1);
    d.Owe(1);
    d.Plan(101);
    Expect(d.Start(101) == 1 && d.Start(101) == 0, "owed starts are skipped by the next start");
    d.Owe(2);
    Expect(d.Start(101) == 2, "owed starts are skipped within an execution too");
  }
  {  // starts replayed from a command buffer: the handler ran at the recording only,
    // the device counts every replay's starts in the line the recording named
    Device d;
    d.Plan(100);
    const int s = d.book.SlotOf(100);
    int64_t tombs = 0;
    for (uint32_t run = 100; run < 110; ++run) {
      if (run != 105) d.Plan(run);  // (105's initialize stage: its line is found all the same)
      if (run == 104) continue;     // execution 104 failed before its start
      tombs += dfccl::RunSlotStart(d.line[s], d.owed[s], run);
    }
    Expect(tombs == 1, "a captured program's left-behind start is skipped once");
  }
  {  // a stale command buffer of a forgotten program names a line another program now has:
    // its starts count nothing there, and the line's program stays exact
    Device d(1);
    d.Exec(100, 1);
    const int s = d.book.SlotOf(100);
    for (uint32_t p = 1; p <= RunBook::kPrograms; ++p) d.Exec(5000000u * p, 1);  // program 100 is evicted
    const uint32_t owner = 5000000u * static_cast<uint32_t>(RunBook::kPrograms);
    Expect(d.book.SlotOf(owner) == s, "the line is reused");
    Expect(dfccl::RunSlotStart(d.line[s], d.owed[s], 101) == 0, "an unrelated execution counts nothing");
    d.Plan(owner + 1);
    Expect(d.Start(owner + 1) == 0, "the line's own program is undisturbed");
  }
  {  // the device's table is full: a new program has no line and asks for nothing
    Device d(1);
    d.Exec(100, 1);
    d.Plan(900000);
    Expect(d.book.SlotOf(900000) < 0 && d.Start(900000) == 0, "no line, no tombstones");
  }
  if (Failures()) return 1;
  std::printf("OK\n");
  return 0;
}
