// XLA FFI handlers of the fused overlap ops (CUDA; module _dfccl_overlap).
//
// dfccl_overlap_ag(x[m,K], w[K,n]) -> (out[P*m,n], xg[P*m,K] or [0,K])
//     all_gather(x, rows) @ w; xg (when not empty) receives all_gather(x).
// dfccl_overlap_rs(x[M,k], w[k,N]) -> out[M/P,N]
//     psum_scatter(x @ w, rows).
// Attributes: key (op identity: kind, dtype, shapes), devices (i64, the
// device ordinals of every group, a row of group_size per group, in rank
// order), group_size, timeout_ns (bound of every cross-rank wait; from
// jax_dfccl.config.overlap.wait_timeout_s), mode (protocol.h enum Mode: copy
// engine for AG rows, one fence per CTA in RS, copy engine for RS partials).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace dfccl::overlap {

XLA_FFI_DECLARE_HANDLER_SYMBOL(OverlapAgCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OverlapRsCuda);

// Errors recorded by timed-out waits so far (one line per channel).
std::vector<std::string> Errors();

// Diagnostics: no_comm (fused GEMM without waits or remote stores; results
// invalid) and profile (CUDA-event time of every fused GEMM kernel and side-
// stream transfer, plus the device timeline of every launch summarized per
// launch; collected and cleared by ProfileResults: (op key|gemm[_nocomm] /
// |push / |copy / |host / |tl_<what>, ms); tl_* are described at Summarize in
// handlers.cc).
void SetDiag(bool no_comm, bool profile);
std::vector<std::pair<std::string, float>> ProfileResults();

}  // namespace dfccl::overlap
