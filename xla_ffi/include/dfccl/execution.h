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
// xla_ffi/device/task.h; docs/design/execution_identity.md, "GPUs").  The submit
// kernels keep it in device memory (DeviceShared::run_slot), in stream order,
// whether XLA runs the start's handler or replays it from a command buffer; the
// host (xla_ffi/runtime/run_book.h) only opens it and counts its call sites.
struct RunLine {
  uint32_t last;      // the program's latest execution seen (a launch id)
  uint32_t pad;
  int64_t count;      // starts of the key by execution `last` so far
  int64_t expected;   // the most starts of the key one execution made
  int64_t owed;       // starts left behind, not yet submitted as tombstones
  int64_t sites;      // the program's call sites of the key (an execution's least; written by the host)
};

// What the program's executions from l.last up to `run` (excluded) did not
// start: per execution the most any made, at least one per call site.
DFCCL_RUN_HD int64_t RunLineMissing(const RunLine& l, uint32_t run) {
  const int64_t per = l.expected > l.sites ? l.expected : l.sites;
  const int64_t between = static_cast<int64_t>(static_cast<uint32_t>(run - l.last)) - 1;
  const int64_t rest = per - l.count;
  return (rest > 0 ? rest : 0) + between * per;
}

// A start of the key by execution `run`: counts it, returns the tombstones to
// submit before it.  The first start of a later execution closes the earlier
// ones: what they did not start (RunLineMissing) is owed, with what the host
// found owed (l.owed).  A start of an earlier or an unrelated execution (another
// program whose stale command buffer still names this line) counts nothing.
DFCCL_RUN_HD int64_t RunLineStart(RunLine& l, uint32_t run) {
  int64_t n = 0;
  if (run != l.last) {
    if (CompareRuns(run, l.last) != RunOrder::kLater) return 0;
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

// A line as the device keeps it: the owed starts come from the host as a running
// total (DeviceShared::run_owed, written by the host alone), of which `taken`
// have been submitted.
struct RunSlot {
  RunLine line;
  int64_t taken;
};

// RunLineStart on a slot, given the host's running total of owed starts.
DFCCL_RUN_HD int64_t RunSlotStart(RunSlot& s, int64_t owed_total, uint32_t run) {
  s.line.owed = owed_total - s.taken;
  const int64_t n = RunLineStart(s.line, run);
  s.taken = owed_total - s.line.owed;
  return n;
}

}  // namespace dfccl
