// The host-side description of one collective, shared by the CPU and CUDA
// backends.  It is decoded from the FFI attributes in one place
// (xla_ffi/ffi/attrs.h) and identifies an instance by (group, key, sequence):
// collectives are matched across ranks by identity, never by issue order.
//
// Buffer semantics, per rank, with E = elems_per_block and n = nranks
// (the Python layer reshapes/transposes so every op has this canonical form):
//   ALL_REDUCE      in: E          out: E          out = reduce_r in_r
//   ALL_GATHER      in: E          out: n*E        out[r] = in_r
//   REDUCE_SCATTER  in: n*E        out: E          out = reduce_r in_r[me]
//   ALL_TO_ALL      in: n*E        out: n*E        out[r] = in_r[me]
//   PPERMUTE        in: E          out: E          out = in_{recv_from} (or 0)
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace dfccl {

enum class OpKind : int32_t {
  kAllReduce = 0,
  kAllGather = 1,
  kReduceScatter = 2,
  kAllToAll = 3,
  kPermute = 4,
};

enum class ReduceOp : int32_t { kSum = 0, kMax = 1, kMin = 2 };

inline const char* OpKindName(OpKind k) {
  switch (k) {
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAllToAll: return "all_to_all";
    case OpKind::kPermute: return "ppermute";
  }
  return "?";
}

inline const char* ReduceOpName(ReduceOp r) {
  switch (r) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

// Element types the runtimes support (values match xla::ffi::DataType so the
// FFI buffer's dtype converts directly).  dtype.h dispatches on them.
enum class DType : int32_t {
  kS32 = 4,
  kF16 = 10,
  kF32 = 11,
  kF64 = 12,
  kBF16 = 16,
};

struct CollectiveSpec {
  OpKind kind = OpKind::kAllReduce;
  ReduceOp reduce = ReduceOp::kSum;
  DType dtype = DType::kF32;
  int64_t elem_bytes = 4;
  int64_t elems_per_block = 0;  // E above
  int64_t in_elems = 0;         // per rank
  int64_t out_elems = 0;        // per rank
  int32_t nranks = 1;
  int32_t rank = 0;
  int64_t self_device = 0;             // global device id of this rank
  std::vector<int64_t> group_devices;  // global device id of each rank
  int32_t send_to = -1;                // PPERMUTE: rank I send to, or -1
  int32_t recv_from = -1;              // PPERMUTE: rank I receive from, or -1
  std::string key;                     // readable identity, for messages
  uint64_t key_hash = 0;               // identity used for matching
  int64_t site = 0;                    // the start op in the program

  int64_t in_bytes() const { return in_elems * elem_bytes; }
  int64_t out_bytes() const { return out_elems * elem_bytes; }

  // The group identity: a communicator serves exactly one device group.
  std::string GroupName() const {
    std::ostringstream os;
    for (size_t i = 0; i < group_devices.size(); ++i) os << (i ? "," : "") << group_devices[i];
    return os.str();
  }

  // Everything that all ranks of one instance must agree on.
  std::string Signature() const {
    std::ostringstream os;
    os << OpKindName(kind);
    if (kind == OpKind::kAllReduce || kind == OpKind::kReduceScatter) os << "(" << ReduceOpName(reduce) << ")";
    os << " dtype=" << static_cast<int>(dtype) << " elems=" << in_elems;
    return os.str();
  }
};

}  // namespace dfccl
