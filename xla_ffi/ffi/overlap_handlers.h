// XLA FFI handlers of the fused overlap ops (CUDA; module _dfccl_cuda, built
// with CUTLASS: its attribute has_overlap).
//
// dfccl_overlap_ag(x[m,K], w[K,n]) -> (out[P*m,n], xg[P*m,K] or [0,K])
//     all_gather(x, rows) @ w; xg (when not empty) receives all_gather(x).
// dfccl_overlap_rs(x[M,k], w[k,N]) -> out[M/P,N]
//     psum_scatter(x @ w, rows).
// Attributes: key (the collective key: kind, dtype, shapes), devices (i64,
// the device ordinals of every group, a row of group_size per group, in rank
// order), group_size, mode (protocol.h enum Mode: copy engine for AG rows, one
// fence per CTA in RS, copy engine for RS partials, ...).
//
// Like every collective, an instance is named (group, key, sequence): a
// channel per (communicator, key) in the runtime's fused-op path
// (runtime/overlap_path.h), each call on a rank taking the next sequence
// number of its channel.  Every cross-rank wait is bounded by
// jax_dfccl.config.timeout_s; a failure is recorded by the group's
// communicator with the runtime's code and words (DEADLINE_EXCEEDED naming key,
// sequence and the ranks that never started it), listed in stats()["errors"]
// and raised by the device's next call and by raise_if_failed()
// (docs/design/overlap.md).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace dfccl::overlap {

XLA_FFI_DECLARE_HANDLER_SYMBOL(OverlapAgCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OverlapRsCuda);

}  // namespace dfccl::overlap
