// nanobind module _dfccl_overlap: the fused GEMM+communication overlap ops
// (tile-wise signaling Hopper GEMM, CUTLASS 3 sm90 mainloop), CUDA only.
#include <nanobind/nanobind.h>

#include "overlap/handlers.h"

namespace nb = nanobind;

NB_MODULE(_dfccl_overlap, m) {
  m.doc() = "jax_dfccl fused overlap ops: AG+GEMM and GEMM+RS with tile-wise signaling (sm90)";

  m.def("registrations", [] {
    nb::dict d;
    d["dfccl_overlap_ag"] = nb::capsule(reinterpret_cast<void*>(&dfccl::overlap::OverlapAgCuda));
    d["dfccl_overlap_rs"] = nb::capsule(reinterpret_cast<void*>(&dfccl::overlap::OverlapRsCuda));
    return d;
  });

  // Timeouts recorded by the kernels' bounded waits (one message per channel).
  m.def("errors", [] {
    nb::list out;
    for (auto& e : dfccl::overlap::Errors()) out.append(nb::str(e.c_str()));
    return out;
  });

  // Diagnostics (benchmarks/overlap_diag.py); see handlers.h.
  m.def("_set_diag", &dfccl::overlap::SetDiag, nb::arg("no_comm"), nb::arg("profile"));
  m.def("_profile_results", [] {
    nb::list out;
    for (auto& [k, ms] : dfccl::overlap::ProfileResults()) out.append(nb::make_tuple(nb::str(k.c_str()), ms));
    return out;
  });
}
