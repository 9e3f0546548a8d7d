// The one table of collective kinds and reduce ops.  Every layer derives what
// it needs from it: the C++ enums and names (collective.h), the size rules of
// the FFI decoding (ffi/attrs.h), the CPU backend's and the daemon kernel's
// per-op dispatch (cpu/collectives.h, device/daemon_kernel.cu), and Python's op
// ids (jax_dfccl/_src/core.py reads them from the extension modules'
// `op_table()`; a test compares both).  Adding an op is a row here, then its
// plan in one file per layer.
//
// DFCCL_OP(Enum, name, id, reduces, rule, DeviceTrait)
//   id           the value of the `kind` attribute of the custom calls
//   reduces      combines values with a ReduceOp (else: pure data movement)
//   rule         the canonical per-rank buffers (E = elements per block,
//                n = ranks of the group; the Python layer reshapes to them):
//                  kSame      in E      out E
//                  kGather    in E      out n*E
//                  kScatter   in n*E    out E
//                  kExchange  in n*E    out n*E
//                  kGiven     in: anything; out: the result buffer's size,
//                             checked by the op itself (ragged exchange)
//   DeviceTrait  the daemon kernel's trait class (device/collectives/*.cuh)
//
// What each op does (rank me, in_r = rank r's input):
//   all_reduce         out = reduce_r in_r
//   all_gather         out[r] = in_r
//   reduce_scatter     out = reduce_r in_r[me]
//   all_to_all         out[r] = in_r[me]
//   ppermute           out = in_{recv_from}, or zeros (perm: (src, dst) pairs)
//   broadcast          out = in_{source} (perm: one pair (source, -1))
//   ragged_all_to_all  in = [header | operand], out = the caller's output
//                      (aliased, so rows nobody sends keep their values);
//                      rank r's rows in_r.operand[in_off_r[me], +send_r[me])
//                      land at out[out_off_r[me], ...) (layout: RaggedHeader)
#pragma once

#include <cstdint>

#define DFCCL_OP_TABLE(X)                                                         \
  X(kAllReduce, "all_reduce", 0, true, kSame, AllReduceOp)                        \
  X(kAllGather, "all_gather", 1, false, kGather, AllGatherOp)                     \
  X(kReduceScatter, "reduce_scatter", 2, true, kScatter, ReduceScatterOp)         \
  X(kAllToAll, "all_to_all", 3, false, kExchange, AllToAllOp)                     \
  X(kPermute, "ppermute", 4, false, kSame, PermuteOp)                             \
  X(kBroadcast, "broadcast", 5, false, kSame, BroadcastOp)                        \
  X(kRaggedAllToAll, "ragged_all_to_all", 6, false, kGiven, RaggedAllToAllOp)

// DFCCL_REDUCE(Enum, name, id, Functor): id is the value of the `reduce_op`
// attribute; the functor and its semantics (NaN, infinities, signed zeros)
// are in dfccl/reduce.h.
#define DFCCL_REDUCE_TABLE(X) \
  X(kSum, "sum", 0, SumOp)    \
  X(kMax, "max", 1, MaxOp)    \
  X(kMin, "min", 2, MinOp)

namespace dfccl {

enum class SizeRule : int32_t { kSame, kGather, kScatter, kExchange, kGiven };

enum class OpKind : int32_t {
#define DFCCL_X(E, name, id, reduces, rule, Trait) E = id,
  DFCCL_OP_TABLE(DFCCL_X)
#undef DFCCL_X
};

enum class ReduceOp : int32_t {
#define DFCCL_X(E, name, id, Fn) E = id,
  DFCCL_REDUCE_TABLE(DFCCL_X)
#undef DFCCL_X
};

struct OpInfo {
  OpKind kind;
  const char* name;
  bool reduces;
  SizeRule rule;
};

inline constexpr OpInfo kOps[] = {
#define DFCCL_X(E, name, id, reduces, rule, Trait) {OpKind::E, name, reduces, SizeRule::rule},
    DFCCL_OP_TABLE(DFCCL_X)
#undef DFCCL_X
};
inline constexpr int kNumOps = sizeof(kOps) / sizeof(kOps[0]);

struct ReduceInfo {
  ReduceOp op;
  const char* name;
};
inline constexpr ReduceInfo kReduces[] = {
#define DFCCL_X(E, name, id, Fn) {ReduceOp::E, name},
    DFCCL_REDUCE_TABLE(DFCCL_X)
#undef DFCCL_X
};
inline constexpr int kNumReduces = sizeof(kReduces) / sizeof(kReduces[0]);

// The table row of a kind, or nullptr for a value outside the table.
inline constexpr const OpInfo* FindOp(int32_t id) {
  for (const OpInfo& o : kOps)
    if (static_cast<int32_t>(o.kind) == id) return &o;
  return nullptr;
}
inline constexpr const ReduceInfo* FindReduce(int32_t id) {
  for (const ReduceInfo& r : kReduces)
    if (static_cast<int32_t>(r.op) == id) return &r;
  return nullptr;
}
inline const char* OpKindName(OpKind k) {
  const OpInfo* o = FindOp(static_cast<int32_t>(k));
  return o ? o->name : "?";
}
inline const char* ReduceOpName(ReduceOp r) {
  const ReduceInfo* i = FindReduce(static_cast<int32_t>(r));
  return i ? i->name : "?";
}
inline bool Reduces(OpKind k) {
  const OpInfo* o = FindOp(static_cast<int32_t>(k));
  return o && o->reduces;
}

// The input of a ragged_all_to_all starts with this header, in int64 words
// (written by jax_dfccl/_src/ragged_all_to_all.py), followed by the operand's
// bytes.  With k slices per peer (jax.lax's offsets and sizes have n*k
// entries; slice i goes to rank i / k):
//   [0] row_bytes   bytes of one row (operand and output rows alike)
//   [1] in_rows     rows of the operand
//   [2] out_rows    rows of this rank's output
//   [3] k           slices per peer
//   [4 + 4*i + 0]   input_offsets[i]   slice i: rows of the operand from here
//   [4 + 4*i + 1]   send_sizes[i]      ... this many
//   [4 + 4*i + 2]   output_offsets[i]  ... land at this row of rank i/k's output
//   [4 + 4*i + 3]   recv_sizes[i]      rows this rank receives as rank i/k's slice i%k
struct RaggedHeader {
  static constexpr int64_t kRowBytes = 0, kInRows = 1, kOutRows = 2, kSlices = 3;
  static constexpr int64_t Words(int64_t nranks, int64_t k) { return 4 + 4 * nranks * k; }
  static constexpr int64_t Bytes(int64_t nranks, int64_t k) { return 8 * Words(nranks, k); }
  static constexpr int64_t InOffset(int64_t i) { return 4 + 4 * i; }
  static constexpr int64_t SendSize(int64_t i) { return 5 + 4 * i; }
  static constexpr int64_t OutOffset(int64_t i) { return 6 + 4 * i; }
  static constexpr int64_t RecvSize(int64_t i) { return 7 + 4 * i; }
};

}  // namespace dfccl
