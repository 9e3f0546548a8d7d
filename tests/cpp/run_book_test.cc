// The GPU runtime's execution book (xla_ffi/runtime/run_book.h): how many starts of
// a key the earlier executions of a program left behind, from the launch ids of
// its starts (built and run by tests/cpp/test_cpu_runtime.py under ASan and UBSan).
#include <cstdio>
#include <vector>

#include "runtime/run_book.h"

using dfccl::gpu::RunBook;

namespace {

int failures = 0;

void Expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "run_book_test: %s\n", what);
    failures++;
  }
}

// The tombstones each start asks for: `starts` launch ids in order.
std::vector<int64_t> Feed(RunBook& b, const std::vector<uint32_t>& starts) {
  std::vector<int64_t> out;
  for (uint32_t r : starts) out.push_back(b.Start(r));
  return out;
}

}  // namespace

int main() {
  using V = std::vector<int64_t>;
  {  // three starts an execution; no failure: nothing to skip
    RunBook b;
    Expect(Feed(b, {100, 100, 100, 101, 101, 101, 102, 102, 102}) == V(9, 0), "a steady program skips nothing");
  }
  {  // execution 101 failed before its first start: 102's first start skips its three
    RunBook b;
    Expect(Feed(b, {100, 100, 100, 102, 102, 102}) == V({0, 0, 0, 3, 0, 0}), "a whole execution left behind");
  }
  {  // execution 101 failed after one of its three starts
    RunBook b;
    Expect(Feed(b, {100, 100, 100, 101, 102, 102, 102}) == V({0, 0, 0, 0, 2, 0, 0}), "an execution's tail left behind");
  }
  {  // two executions failed in a row
    RunBook b;
    Expect(Feed(b, {100, 100, 103, 103}) == V({0, 0, 4, 0}), "two executions left behind");
  }
  {  // another program's starts of the key in between (MPMD or a second jitted function)
    RunBook b;
    Expect(Feed(b, {100, 100, 900000, 101, 101, 900001, 103, 103}) == V({0, 0, 0, 0, 0, 0, 2, 0}),
           "programs are booked apart");
  }
  {  // across the 32-bit wrap of launch ids
    RunBook b;
    Expect(Feed(b, {0xfffffffeu, 0xfffffffeu, 0xffffffffu, 0xffffffffu, 1u, 1u}) == V({0, 0, 0, 0, 2, 0}),
           "the wrap of launch ids");
  }
  {  // an execution that starts the key fewer times than the most (a data-dependent loop): every
    // process pads it alike, so the processes stay aligned where none failed
    RunBook a, b;
    const std::vector<uint32_t> h = {100, 100, 100, 101, 102, 102, 102};
    const V ta = Feed(a, h);
    Expect(ta == Feed(b, h), "processes with one history skip alike");
    Expect(ta == V({0, 0, 0, 0, 2, 0, 0}), "a short execution is padded to the program's most");
  }
  {  // process 0 failed before the key in execution 101; process 1 ran it whole:
    // process 0's tombstones take exactly the sequence numbers process 1's 101 took
    RunBook p0, p1;
    const V t0 = Feed(p0, {100, 100, 102, 102});
    const V t1 = Feed(p1, {100, 100, 101, 101, 102, 102});
    auto seqs = [](const V& tombs) {  // sequence numbers of the real starts
      std::vector<int64_t> s;
      int64_t next = 0;
      for (int64_t t : tombs) { next += t; s.push_back(next++); }
      return s;
    };
    const std::vector<int64_t> s0 = seqs(t0), s1 = seqs(t1);
    Expect(s0[2] == s1[4] && s0[3] == s1[5], "the processes' execution 102 takes the same sequence numbers");
  }
  {  // more programs than the book keeps: the oldest goes, the others stay exact
    RunBook b;
    for (uint32_t p = 0; p < RunBook::kPrograms + 4; ++p) b.Start(1000000u * (p + 1));
    Expect(b.Start(1000000u * (RunBook::kPrograms + 4) + 2) == 1, "the latest program is still booked");
  }
  // With XLA's prepare stage (Plan: once per execution and call site, failed executions included).
  {  // the first execution fails before its one start: the retry skips it
    RunBook b;
    b.Plan(100, 7);
    b.Plan(101, 7);
    Expect(b.Start(101) == 1 && b.Start(102) == 0, "a first execution left behind (prepare stage)");
  }
  {  // no failure: nothing owed
    RunBook b;
    b.Plan(100, 7);
    const int64_t a = b.Start(100);
    b.Plan(101, 7);
    Expect(a == 0 && b.Start(101) == 0, "a steady program with its prepare stage skips nothing");
  }
  {  // three starts an execution (a loop); execution 101 fails before the loop
    RunBook b;
    b.Plan(100, 7);
    for (int i = 0; i < 3; ++i) b.Start(100);
    b.Plan(101, 7);
    b.Plan(102, 7);
    Expect(b.Start(102) == 3 && b.Start(102) == 0, "a loop's execution left behind (prepare stage)");
  }
  {  // two call sites of the key; the first execution fails before both
    RunBook b;
    b.Plan(100, 1);
    b.Plan(100, 2);
    b.Plan(101, 1);
    b.Plan(101, 2);
    Expect(b.Start(101) == 2, "one start per call site of a first execution");
  }
  {  // the device found a start ahead of its peers (Owe): the next start skips one more
    RunBook b;
    b.Plan(100, 7);
    b.Start(100);
    b.Owe(1);
    b.Plan(101, 7);
    Expect(b.Start(101) == 1, "owed starts are skipped by the next start");
  }
  {  // a program recorded into a command buffer: its replays' starts are not seen, nothing is owed
    RunBook b;
    b.Plan(100, 7);
    b.Captured(100);
    b.Plan(101, 7);
    b.Plan(102, 7);
    Expect(b.Start(102) == 0, "a captured program owes nothing");
  }
  if (failures) return 1;
  std::printf("OK\n");
  return 0;
}
