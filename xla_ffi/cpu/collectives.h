// The CPU backend's plan of every op (the table in dfccl/ops.h): how rank
// spec.rank's output is computed from every rank's input.  Each rank reads its
// peers' inputs directly (ins[r] = rank r's input buffer).  Reductions use the
// one reduction library (dfccl/reduce.h) with XLA:CPU's semantics; the element
// type is dispatched once, through dfccl::DispatchDType.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dfccl/check.h"
#include "dfccl/collective.h"
#include "dfccl/dtype.h"
#include "dfccl/reduce.h"

namespace dfccl::cpu {

// out[i] = reduce_r ins[r][offset + i], i < count, in rank order.
template <typename T, class R>
void ReduceRanks(const std::vector<const void*>& ins, int64_t offset, int64_t count, void* out) {
  using A = typename Acc<T>::type;
  constexpr int64_t kChunk = 1024;  // accumulator stays in L1
  A acc[kChunk];
  const R op;
  const int n = static_cast<int>(ins.size());
  T* o = static_cast<T*>(out);
  for (int64_t base = 0; base < count; base += kChunk) {
    const int64_t m = std::min(kChunk, count - base);
    const T* p0 = static_cast<const T*>(ins[0]) + offset + base;
    for (int64_t i = 0; i < m; ++i) acc[i] = Begin<R, kHostStart>(Acc<T>::Load(p0[i]));
    for (int r = 1; r < n; ++r) {
      const T* p = static_cast<const T*>(ins[r]) + offset + base;
      for (int64_t i = 0; i < m; ++i) acc[i] = op(acc[i], Acc<T>::Load(p[i]));
    }
    for (int64_t i = 0; i < m; ++i) o[base + i] = Acc<T>::Store(acc[i]);
  }
}

inline void Reduce(const CollectiveSpec& s, const std::vector<const void*>& ins, int64_t offset, int64_t count,
                   void* out) {
  DispatchDType(s.dtype, [&]<typename T>() {
    DispatchReduce(s.reduce, [&]<class R>() { ReduceRanks<T, R>(ins, offset, count, out); });
  });
}

// One specialization per op: Run(spec, ins, out).  Sizes are in elements of
// spec.dtype unless said otherwise; E = spec.elems_per_block.
template <OpKind K>
struct CpuOp;

template <>
struct CpuOp<OpKind::kAllReduce> {
  static void Run(const CollectiveSpec& s, const std::vector<const void*>& ins, void* out) {
    Reduce(s, ins, 0, s.elems_per_block, out);
  }
};

template <>
struct CpuOp<OpKind::kReduceScatter> {
  static void Run(const CollectiveSpec& s, const std::vector<const void*>& ins, void* out) {
    Reduce(s, ins, s.rank * s.elems_per_block, s.elems_per_block, out);
  }
};

template <>
struct CpuOp<OpKind::kAllGather> {
  static void Run(const CollectiveSpec& s, const std::vector<const void*>& ins, void* out) {
    const int64_t B = s.elems_per_block * s.elem_bytes;
    for (int64_t r = 0; r < s.nranks; ++r) std::memcpy(static_cast<char*>(out) + r * B, ins[r], B);
  }
};

template <>
struct CpuOp<OpKind::kAllToAll> {
  static void Run(const CollectiveSpec& s, const std::vector<const void*>& ins, void* out) {
    const int64_t B = s.elems_per_block * s.elem_bytes;
    for (int64_t r = 0; r < s.nranks; ++r)
      std::memcpy(static_cast<char*>(out) + r * B, static_cast<const char*>(ins[r]) + s.rank * B, B);
  }
};

// ppermute and broadcast: out = in_{recv_from}, or zeros when nobody sends.
inline void CopyFrom(const CollectiveSpec& s, const std::vector<const void*>& ins, void* out) {
  const int64_t B = s.elems_per_block * s.elem_bytes;
  if (s.recv_from < 0) {
    std::memset(out, 0, B);
  } else {
    DFCCL_CHECK(s.recv_from < s.nranks, "dfccl: collective '" << s.key << "': bad source rank " << s.recv_from);
    std::memcpy(out, ins[s.recv_from], B);
  }
}
template <>
struct CpuOp<OpKind::kPermute> {
  static void Run(const CollectiveSpec& s, const std::vector<const void*>& ins, void* out) { CopyFrom(s, ins, out); }
};
template <>
struct CpuOp<OpKind::kBroadcast> {
  static void Run(const CollectiveSpec& s, const std::vector<const void*>& ins, void* out) { CopyFrom(s, ins, out); }
};

// ragged_all_to_all: the slices every rank sends this one, placed into the
// output (which already holds the caller's values: rows nobody sends keep them).
template <>
struct CpuOp<OpKind::kRaggedAllToAll> {
  static void Run(const CollectiveSpec& s, const std::vector<const void*>& ins, void* out) {
    using H = RaggedHeader;
    const int64_t n = s.nranks, me = s.rank;
    const int64_t* mine = static_cast<const int64_t*>(ins[me]);
    const int64_t row = mine[H::kRowBytes], k = mine[H::kSlices];
    const int64_t out_rows = mine[H::kOutRows];
    DFCCL_CHECK(row >= 0 && out_rows >= 0 && out_rows * row <= s.out_bytes(),
                "dfccl: ragged_all_to_all '" << s.key << "': malformed header of rank " << me);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t* h = static_cast<const int64_t*>(ins[r]);
      DFCCL_CHECK(h[H::kRowBytes] == row && h[H::kSlices] == k,
                  "dfccl: ragged_all_to_all '" << s.key << "': ranks " << r << " and " << me
                                               << " disagree on the row size or the slices per peer");
      DFCCL_CHECK(s.in_bytes() >= H::Bytes(n, k) + h[H::kInRows] * row,
                  "dfccl: ragged_all_to_all '" << s.key << "': malformed input of rank " << r);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = me * k + j;  // r's slice to me
        const int64_t off = h[H::InOffset(i)], size = h[H::SendSize(i)], dst = h[H::OutOffset(i)];
        const int64_t want = mine[H::RecvSize(r * k + j)];
        DFCCL_CHECK(size == want, "dfccl: ragged_all_to_all '" << s.key << "': rank " << r << " sends " << size
                                      << " rows to rank " << me << " (slice " << j << "), whose recv_sizes["
                                      << r * k + j << "] is " << want);
        DFCCL_CHECK(size >= 0 && off >= 0 && off + size <= h[H::kInRows] && dst >= 0 && dst + size <= out_rows,
                    "dfccl: ragged_all_to_all '" << s.key << "': rank " << r << " sends rows [" << off << ", "
                                                 << off + size << ") of its " << h[H::kInRows] << " to rows [" << dst
                                                 << ", " << dst + size << ") of rank " << me << "'s " << out_rows);
        if (size > 0)
          std::memcpy(static_cast<char*>(out) + dst * row,
                      reinterpret_cast<const char*>(h) + H::Bytes(n, k) + off * row, size * row);
      }
    }
  }
};

// Computes rank spec.rank's output from every rank's input.  Throws dfccl::Error.
inline void ExecuteCollective(const CollectiveSpec& s, const std::vector<const void*>& ins, void* out) {
  DFCCL_CHECK(static_cast<int64_t>(ins.size()) == s.nranks, "dfccl: internal: wrong number of inputs");
  if (s.elems_per_block == 0) return;  // zero-sized buffers may be null
  switch (s.kind) {
#define DFCCL_X(E, name, id, reduces, rule, Trait) \
  case OpKind::E:                                  \
    return CpuOp<OpKind::E>::Run(s, ins, out);
    DFCCL_OP_TABLE(DFCCL_X)
#undef DFCCL_X
  }
  DFCCL_FAIL("dfccl: bad op kind " << static_cast<int>(s.kind));
}

// The same, its error as a value (daemon threads complete tasks with it);
// `target()` gives the output buffer (it may allocate it, and fail).
template <class Target>
inline Status ExecuteCollectiveStatus(const CollectiveSpec& s, const std::vector<const void*>& ins, Target&& target) {
  try {
    ExecuteCollective(s, ins, target());
    return {};
  } catch (const Error& e) {
    return Status::Of(e);
  } catch (const std::exception& e) {
    return {ErrorCode::kInternal, e.what()};
  }
}

}  // namespace dfccl::cpu
