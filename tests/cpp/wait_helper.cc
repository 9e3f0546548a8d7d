// The device's one wait (xla_ffi/device/wait.cuh) on the host: its thread waits
// compiled with g++ through tests/cpp/device_shim, whose clock and sleep count
// what a wait does.  Checks, for the policies the device uses (DoneWordWait,
// HostWordWait, LockWait) and for a test policy with an abort check:
//  - a wait that is over at once costs one poll: no clock read, no sleep;
//  - the back-off schedule: which polls are preceded by a sleep, and how long;
//  - the clock's cadence (kClockEvery) and the abort check's (kAbortEvery),
//    and the poll index a predicate may take (0 first, then 1, 2, ...);
//  - the bound: kBound after more than bound_ns, not much later; kAborted when
//    the abort check fires (before the bound);
//  - the fatal form: the report runs, then the trap (a child process, SIGABRT).
// Built and run under ASan and UBSan by tests/cpp/test_cpu_runtime.py.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "device/wait.cuh"

#include "check.h"

using namespace dfccl::gpu;


namespace {

// A predicate that holds from its `at`-th poll on (0: the first), counting its polls.
struct ReadyAt {
  uint32_t at;
  uint32_t polls = 0;
  bool operator()() { return polls++ >= at; }
};

ShimCounts Reset() {
  const ShimCounts before = shim_counts;
  shim_counts = ShimCounts{};
  return before;
}

// A wait of policy P whose predicate holds at poll `at`: the counts it made.
template <class P>
ShimCounts Run(uint32_t at, uint32_t* polls) {
  ReadyAt r{at};
  Reset();
  CHECK(SpinWait<P>(r, uint64_t{60} * 1000000000) == WaitEnd::kReady);
  *polls = r.polls;
  return Reset();
}

// Expected counts of P for a predicate holding at poll `at` (the loop's
// iterations it = 0 .. at-1 sleep P's schedule before poll it + 1; the clock is
// read once at the first failed poll, then after every failed poll it + 1 with
// it % kClockEvery == kClockEvery - 1 — the last poll succeeds, no look after it).
template <class P>
ShimCounts Expected(uint32_t at, uint64_t (*sleep_ns)(uint32_t)) {
  ShimCounts e;
  if (at == 0) return e;
  e.clock_reads = 1;
  for (uint32_t it = 0; it < at; ++it) {
    const uint64_t ns = sleep_ns(it);
    if (ns) { ++e.sleeps; e.slept_ns += ns; }
    if (it + 1 < at && it % P::kClockEvery == P::kClockEvery - 1) ++e.clock_reads;
  }
  return e;
}

template <class P>
void CheckSchedule(const char* name, uint64_t (*sleep_ns)(uint32_t)) {
  for (uint32_t at : {0u, 1u, 2u, 64u, 65u, 66u, 1023u, 1024u, 1025u, 1026u, 4096u, 4097u, 4098u, 6000u}) {
    uint32_t polls = 0;
    const ShimCounts got = Run<P>(at, &polls);
    const ShimCounts want = Expected<P>(at, sleep_ns);
    if (polls != at + 1 || got.clock_reads != want.clock_reads || got.sleeps != want.sleeps ||
        got.slept_ns != want.slept_ns) {
      std::fprintf(stderr,
                   "%s, ready at poll %u: polls %u (want %u), clock reads %llu (%llu), sleeps %llu (%llu), "
                   "slept %llu ns (%llu)\n",
                   name, at, polls, at + 1, (unsigned long long)got.clock_reads, (unsigned long long)want.clock_reads,
                   (unsigned long long)got.sleeps, (unsigned long long)want.sleeps, (unsigned long long)got.slept_ns,
                   (unsigned long long)want.slept_ns);
      std::exit(1);
    }
  }
}

// The schedules as written before the one wait (submit.cuh AwaitDoneWord:
// `if (i > 64) __nanosleep(i > 4096 ? 256 : 32)`; stream_wait.cu: 200 ns each
// poll; match.cuh LockBucket: the second attempt at once, then 32 ns).
uint64_t DoneSleep(uint32_t it) { return it > 64 ? (it > 4096 ? 256 : 32) : 0; }
uint64_t HostSleep(uint32_t) { return 200; }
uint64_t LockSleep(uint32_t it) { return it > 0 ? 32 : 0; }

// A test policy with an abort check: the clock every 4 failed polls, the abort every 16.
struct AbortEvery16 : WaitPolicy {
  static constexpr uint32_t kClockEvery = 4;
  static constexpr uint32_t kAbortEvery = 16;
};

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main() {
  // Over at once: one poll, no clock read, no sleep (every policy).
  {
    uint32_t polls = 0;
    const ShimCounts c = Run<DoneWordWait>(0, &polls);
    CHECK(polls == 1 && c.clock_reads == 0 && c.sleeps == 0);
  }
  CheckSchedule<DoneWordWait>("DoneWordWait", DoneSleep);
  CheckSchedule<HostWordWait>("HostWordWait", HostSleep);
  CheckSchedule<LockWait>("LockWait", LockSleep);

  // The poll index: 0 for the first poll, then 1, 2, ... (overlap/sync.cuh's
  // WaitReady polls the host word at indices k * kHostPollEvery + 1... from it).
  {
    std::vector<uint32_t> seen;
    const WaitEnd end = SpinWait<WaitPolicy>(
        [&](uint32_t n) {
          seen.push_back(n);
          return n == 10;
        },
        uint64_t{1000000000});
    CHECK(end == WaitEnd::kReady && seen.size() == 11);
    for (uint32_t i = 0; i < seen.size(); ++i) CHECK(seen[i] == i);
  }

  // The bound: kBound after more than bound_ns, for a clock read every poll and
  // every 1024 polls; the first clock look past the bound ends it (the clock
  // reads: the first failed poll's, then one per look).  (The upper limit on
  // the time is loose: the shim's sleep yields the CPU, slow on a loaded host.)
  for (uint64_t bound_ns : {uint64_t{0}, uint64_t{2000000}, uint64_t{20000000}}) {
    uint32_t polls = 0;
    Reset();
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(SpinWait<LockWait>([&] { ++polls; return false; }, bound_ns) == WaitEnd::kBound);
    const double s = Seconds(t0);
    CHECK(s >= bound_ns * 1e-9 && s < bound_ns * 1e-9 + 30);
    CHECK(Reset().clock_reads == polls);  // LockWait: a look after every failed poll but the first
    polls = 0;
    const auto t1 = std::chrono::steady_clock::now();
    CHECK(SpinWait<DoneWordWait>([&] { ++polls; return false; }, bound_ns) == WaitEnd::kBound);
    const double s1 = Seconds(t1);
    CHECK(s1 >= bound_ns * 1e-9 && s1 < bound_ns * 1e-9 + 30);
    CHECK(polls % 1024 == 1 && Reset().clock_reads == 1 + polls / 1024);  // ends at a look
  }

  // The abort check: only at failed polls it with it % 16 == 15, never on the
  // first poll; kAborted once it fires, before any bound.
  {
    std::vector<uint32_t> at;  // the failed polls (it) at which the abort was checked
    uint32_t it_now = 0;
    int checks = 0;
    const WaitEnd end = SpinWait<AbortEvery16>(
        [&](uint32_t n) {
          it_now = n == 0 ? 0 : n - 1;
          return false;
        },
        uint64_t{60} * 1000000000, [&] {
          at.push_back(it_now);
          return ++checks == 3;
        });
    CHECK(end == WaitEnd::kAborted);
    CHECK(at.size() == 3 && at[0] == 15 && at[1] == 31 && at[2] == 47);
  }
  // No abort before the condition: a wait that ends ready never reports an abort.
  {
    ReadyAt r{40};
    CHECK(SpinWait<AbortEvery16>(r, uint64_t{60} * 1000000000, [] { return false; }) == WaitEnd::kReady);
  }

  // The fatal form: ready, it returns without a report; at the bound the report
  // runs (sees kBound), then the trap kills the process.
  {
    bool reported = false;
    SpinWaitOrTrap<LockWait>([] { return true; }, 0, NoAbort{}, [&](WaitEnd) { reported = true; });
    CHECK(!reported);
    std::fflush(nullptr);
    const pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
      SpinWaitOrTrap<LockWait>([] { return false; }, 1000000, NoAbort{}, [](WaitEnd end) {
        std::fprintf(stderr, "(expected) report: %s\n", end == WaitEnd::kBound ? "bound" : "other");
        _exit(end == WaitEnd::kBound ? 42 : 43);  // the report ran with kBound
      });
      _exit(44);  // not reached
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 42);
    const pid_t pid2 = fork();
    CHECK(pid2 >= 0);
    if (pid2 == 0) {
      signal(SIGABRT, SIG_DFL);
      SpinWaitOrTrap<LockWait>([] { return false; }, 1000000, NoAbort{}, [](WaitEnd) {});
      _exit(44);  // not reached: the trap
    }
    CHECK(waitpid(pid2, &status, 0) == pid2);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
  }
  std::printf("OK\n");
  return 0;
}
