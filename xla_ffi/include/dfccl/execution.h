// Which execution a start belongs to, across processes (docs/design/execution_identity.md).
//
// A process whose program fails *before* a start its peers made never reaches
// that start; counted per key alone, its next execution's start would take the
// same sequence number and pair with the peers' old instance: both sides would
// return each other's inputs from runs that do not belong together, without an
// error.  So every start carries the identity XLA itself gives an execution
// across processes: the launch id (the FFI RunId), which jaxlib derives from
// the executable's fingerprint plus the number of executions of that
// executable this process has launched — failed ones included.  The k-th
// execution of one program has the same launch id in every process of the job.
//
// Two starts of one instance (group, key, sequence):
//   equal launch ids          the same execution: they pair;
//   ids a few apart (< kRunWindow)
//                             the same program, in executions k and k + d: the
//                             process at k + d left execution k behind (it
//                             failed before it started this collective), so
//                             the ranks of execution k fail (ABORTED, "a peer's
//                             program failed") and the rank of k + d moves on to
//                             the key's next sequence number, where the peers'
//                             execution k + d will start it;
//   ids far apart             different programs (MPMD: their fingerprints
//                             differ): matched by key and sequence as before.
// Launch ids are 32-bit, so "a few apart" is a difference modulo 2^32.  Two
// different programs whose fingerprints land within kRunWindow of each other
// (probability about 2 * kRunWindow / 2^32 per pair) would be taken for one:
// their instances fail loudly (never a silent result) until their execution
// counts meet.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DFCCL_RUN_HD __host__ __device__ __forceinline__
#else
#define DFCCL_RUN_HD inline
#endif

namespace dfccl {

inline constexpr int32_t kRunWindow = 1 << 10;

enum class RunOrder { kSame, kEarlier, kLater, kUnrelated };

// How execution `a` stands to execution `b` (launch ids): kEarlier when `a` is
// an earlier execution of the same program than `b`.  (The CPU runtime's shared
// instance table and the GPU's match table both compare with it.)
DFCCL_RUN_HD RunOrder CompareRuns(int64_t a, int64_t b) {
  const int32_t d = static_cast<int32_t>(static_cast<uint32_t>(a) - static_cast<uint32_t>(b));
  if (d == 0) return RunOrder::kSame;
  if (d > -kRunWindow && d < kRunWindow) return d < 0 ? RunOrder::kEarlier : RunOrder::kLater;
  return RunOrder::kUnrelated;
}

// One program's line of a key's execution book (protocol "run" in
// xla_ffi/device/task.h; docs/design/execution_identity.md, "GPUs"): the
// arithmetic of xla_ffi/runtime/run_book.h, in a form a kernel can run too.
struct RunLine {
  uint32_t last;      // the program's latest execution seen (a launch id)
  uint32_t captured;  // 1: its starts are recorded into a command buffer (not seen by the host)
  int64_t count;      // starts of the key by execution `last` so far
  int64_t expected;   // the most starts of the key one execution made
  int64_t owed;       // starts left behind, not yet submitted as tombstones
  int64_t sites;      // the program's call sites of the key (an execution's least)
};

// What the program's executions from l.last up to `run` (excluded) did not
// start: per execution the most any made, at least one per call site.
DFCCL_RUN_HD int64_t RunLineMissing(const RunLine& l, uint32_t run) {
  const int64_t per = l.expected > l.sites ? l.expected : l.sites;
  const int64_t between = static_cast<int64_t>(static_cast<uint32_t>(run - l.last)) - 1;
  const int64_t rest = per - l.count;
  return (rest > 0 ? rest : 0) + between * per;
}

// Execution `run` of the program begins (XLA's prepare stage): the previous one
// is over, what it did not start is owed.
DFCCL_RUN_HD void RunLinePlan(RunLine& l, uint32_t run) {
  if (run == l.last || CompareRuns(run, l.last) != RunOrder::kLater) return;
  if (!l.captured) l.owed += RunLineMissing(l, run);
  l.last = run;
  l.count = 0;
}

// A start of the key by execution `run`: counts it, returns the tombstones to
// submit before it (what is owed, and what executions no prepare stage
// announced left behind).
DFCCL_RUN_HD int64_t RunLineStart(RunLine& l, uint32_t run) {
  int64_t n = 0;
  if (run != l.last) {
    if (CompareRuns(run, l.last) != RunOrder::kLater) return 0;  // an older execution (not in one process)
    n = RunLineMissing(l, run);
    l.last = run;
    l.count = 0;
  }
  l.count++;
  if (l.count > l.expected) l.expected = l.count;
  n += l.owed;
  l.owed = 0;
  return n;
}

}  // namespace dfccl
