// The host-side description of one collective, shared by the CPU and CUDA
// backends.  It is decoded from the FFI attributes in one place
// (xla_ffi/ffi/attrs.h) and identifies an instance by (group, key, sequence):
// collectives are matched across ranks by identity, never by issue order.
//
// The canonical buffers of every op and what it computes are defined in
// dfccl/ops.h (the op table).
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "dfccl/ops.h"

namespace dfccl {

// Element types the runtimes compute on: the one dtype table.
// DFCCL_DTYPE(Enum, id, name, bytes, CType): id matches xla::ffi::DataType (so
// an FFI buffer's dtype converts directly), name is numpy's (Python's
// SUPPORTED_DTYPES come from it), CType the C++ type (the 16-bit floats come
// from the caller's type set `Types`, see dtype.h).
#define DFCCL_DTYPE_TABLE(X)                    \
  X(kS32, 4, "int32", 4, int32_t)               \
  X(kF16, 10, "float16", 2, typename Types::f16) \
  X(kF32, 11, "float32", 4, float)              \
  X(kF64, 12, "float64", 8, double)             \
  X(kBF16, 16, "bfloat16", 2, typename Types::bf16)

enum class DType : int32_t {
#define DFCCL_X(E, id, name, bytes, CType) E = id,
  DFCCL_DTYPE_TABLE(DFCCL_X)
#undef DFCCL_X
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
  int32_t send_to = -1;                // ppermute: rank I send to, or -1; broadcast: -2 (every rank) at the source
  int32_t recv_from = -1;              // ppermute: rank I receive from, or -1; broadcast: the source
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
    if (Reduces(kind)) os << "(" << ReduceOpName(reduce) << ")";
    os << " dtype=" << static_cast<int>(dtype) << " elems=" << in_elems;
    return os.str();
  }
};

}  // namespace dfccl
