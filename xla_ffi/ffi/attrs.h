// The FFI signature of the collective custom calls, shared by the CPU and CUDA
// handlers, and its decoding into a dfccl::CollectiveSpec.
//
// dfccl_start(x, partition_id[, init]) -> (out, x_alias, ticket)
//   x             the rank's input (any supported dtype)
//   partition_id  s32[] this program instance's partition id (flat mesh index)
//   init          only for ops whose result starts from the caller's values
//                 (ragged_all_to_all): aliased to out
//   out           the result buffer; the GPU runtime writes it asynchronously after start
//                 returns (the CPU runtime writes done's result, or its own memory)
//   x_alias       aliases x: keeps the input alive until done consumes it (GPU; a program
//                 lowered for CPU alone leaves it unaliased: the CPU runtime copies x at start)
//   ticket        s64[] identifies the started instance on this device (CPU; the
//                 CUDA backend pairs start and done by a FIFO per (device, site))
// dfccl_done(out, x_alias, ticket) -> result
//   (aliased to out only in the blocking form, whose handle has no other user)
//   waits (host thread on CPU, stream on GPU) until the instance completed.
// dfccl_collective(x, partition_id) -> out   (CUDA only)
//   the blocking form: start and done in one call, dfccl_start's attributes.
//
// Attributes of dfccl_start (all set by jax_dfccl/_src/core.py):
//   kind        OpKind           reduce_op  ReduceOp
//   key         readable key     key_hash   64-bit identity of the key
//   site        id of the start op in the program (start/done pairing)
//   group_size  ranks per group
//   groups      (num_groups*group_size) partition ids, a row per group, in rank order
//   device_ids  global device id of each partition id
//   perm        ppermute: (src, dst) rank pairs, flattened; broadcast: (source, -1);
//               (-1, -1) otherwise
// Attributes of dfccl_done: key, site.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dfccl/check.h"
#include "dfccl/collective.h"
#include "dfccl/dtype.h"
#include "xla/ffi/api/ffi.h"

namespace dfccl {

struct StartAttrs {
  int32_t kind;
  int32_t reduce_op;
  std::string_view key;
  int64_t key_hash;
  int64_t site;
  int32_t group_size;
  xla::ffi::Span<const int32_t> groups;
  xla::ffi::Span<const int64_t> device_ids;
  xla::ffi::Span<const int32_t> perm;
};

struct DoneAttrs {
  std::string_view key;
  int64_t site;
};

// The global device ids of the group that partition `partition_id` belongs to, and
// its rank there (*rank).  Throws dfccl::Error.
inline std::vector<int64_t> GroupOf(const StartAttrs& a, int32_t partition_id, int32_t* rank) {
  DFCCL_CHECK(a.group_size >= 1 && a.groups.size() % a.group_size == 0,
              "dfccl: collective '" << a.key << "': malformed group table");
  const int64_t ngroups = a.groups.size() / a.group_size;
  int64_t row = -1;
  for (int64_t g = 0; g < ngroups && row < 0; ++g)
    for (int32_t r = 0; r < a.group_size; ++r)
      if (a.groups[g * a.group_size + r] == partition_id) { row = g; *rank = r; break; }
  DFCCL_CHECK(row >= 0, "dfccl: collective '" << a.key << "': partition " << partition_id << " is in no group");
  std::vector<int64_t> group(a.group_size);
  for (int32_t r = 0; r < a.group_size; ++r) {
    int32_t p = a.groups[row * a.group_size + r];
    DFCCL_CHECK(p >= 0 && p < static_cast<int64_t>(a.device_ids.size()), "dfccl: bad group table");
    group[r] = a.device_ids[p];
  }
  return group;
}

// Builds the spec of one rank's part of a collective; `out_elems` is the result
// buffer's size, checked against the op's size rule (dfccl/ops.h).  Throws dfccl::Error.
inline CollectiveSpec ParseSpec(const StartAttrs& a, int32_t partition_id,
                                xla::ffi::DataType dtype, int64_t in_elems, int64_t out_elems) {
  CollectiveSpec s;
  const OpInfo* op = FindOp(a.kind);
  DFCCL_CHECK(op != nullptr, "dfccl: collective '" << a.key << "': unknown op kind " << a.kind);
  DFCCL_CHECK(FindReduce(a.reduce_op) != nullptr, "dfccl: collective '" << a.key << "': unknown reduce op " << a.reduce_op);
  DFCCL_CHECK(IsSupportedDType(static_cast<int32_t>(dtype)),
              "dfccl: collective '" << a.key << "': unsupported element type " << static_cast<int>(dtype));
  s.kind = static_cast<OpKind>(a.kind);
  s.reduce = static_cast<ReduceOp>(a.reduce_op);
  s.dtype = static_cast<DType>(dtype);
  s.elem_bytes = DTypeBytes(s.dtype);
  s.key = std::string(a.key);
  s.key_hash = static_cast<uint64_t>(a.key_hash);
  s.site = a.site;
  s.nranks = a.group_size;
  DFCCL_CHECK(partition_id >= 0 && partition_id < static_cast<int64_t>(a.device_ids.size()),
              "dfccl: collective '" << a.key << "': partition id " << partition_id << " outside the mesh");
  s.self_device = a.device_ids[partition_id];
  s.group_devices = GroupOf(a, partition_id, &s.rank);
  s.in_elems = in_elems;
  const int64_t n = s.nranks;
  auto divisible = [&] {
    DFCCL_CHECK(in_elems % n == 0, "dfccl: collective '" << a.key << "': input of " << in_elems
                                       << " elements not divisible by the group size " << n);
  };
  switch (op->rule) {
    case SizeRule::kSame: s.elems_per_block = in_elems; s.out_elems = in_elems; break;
    case SizeRule::kGather: s.elems_per_block = in_elems; s.out_elems = n * in_elems; break;
    case SizeRule::kScatter: divisible(); s.elems_per_block = in_elems / n; s.out_elems = in_elems / n; break;
    case SizeRule::kExchange: divisible(); s.elems_per_block = in_elems / n; s.out_elems = in_elems; break;
    case SizeRule::kGiven: s.elems_per_block = in_elems; s.out_elems = out_elems; break;
  }
  DFCCL_CHECK(out_elems == s.out_elems, "dfccl: collective '" << a.key << "': result has " << out_elems
                                            << " elements, expected " << s.out_elems);
  // Pairs (src, dst) of ranks: a ppermute's permutation; a broadcast's (source, -1).
  for (size_t i = 0; i + 1 < a.perm.size(); i += 2) {
    if (a.perm[i] < 0) continue;
    DFCCL_CHECK(a.perm[i] < n && a.perm[i + 1] < n, "dfccl: collective '" << a.key << "': rank pair ("
                    << a.perm[i] << ", " << a.perm[i + 1] << ") outside the group of " << n);
    if (s.kind == OpKind::kBroadcast) {
      s.recv_from = a.perm[i];
      s.send_to = a.perm[i] == s.rank ? -2 : -1;
      continue;
    }
    if (a.perm[i] == s.rank) s.send_to = a.perm[i + 1];
    if (a.perm[i + 1] == s.rank) s.recv_from = a.perm[i];
  }
  DFCCL_CHECK(s.kind != OpKind::kBroadcast || s.recv_from >= 0,
              "dfccl: collective '" << a.key << "': broadcast without a source rank");
  if (s.kind == OpKind::kRaggedAllToAll) {
    DFCCL_CHECK(s.dtype == DType::kS32 && in_elems * 4 >= RaggedHeader::Bytes(n, 0),
                "dfccl: collective '" << a.key << "': malformed ragged_all_to_all input");
  }
  return s;
}

}  // namespace dfccl

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::dfccl::StartAttrs,
    ::xla::ffi::StructMember<int32_t>("kind"),
    ::xla::ffi::StructMember<int32_t>("reduce_op"),
    ::xla::ffi::StructMember<std::string_view>("key"),
    ::xla::ffi::StructMember<int64_t>("key_hash"),
    ::xla::ffi::StructMember<int64_t>("site"),
    ::xla::ffi::StructMember<int32_t>("group_size"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int32_t>>("groups"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("device_ids"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int32_t>>("perm"));

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::dfccl::DoneAttrs,
    ::xla::ffi::StructMember<std::string_view>("key"),
    ::xla::ffi::StructMember<int64_t>("site"));
