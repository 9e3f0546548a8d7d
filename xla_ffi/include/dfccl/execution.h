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

}  // namespace dfccl
