// nanobind module _dfccl_overlap: the fused GEMM+communication overlap ops
// (tile-wise signaling Hopper GEMM, CUTLASS 3 sm90 mainloop), CUDA only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bindings/errors.h"
#include "overlap/handlers.h"
#include "overlap/plan.h"

namespace nb = nanobind;

NB_MODULE(_dfccl_overlap, m) {
  m.doc() = "jax_dfccl fused overlap ops: AG+GEMM and GEMM+RS with tile-wise signaling (sm90)";
  dfccl::RegisterErrorTranslator();  // bindings/errors.h

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

  // The plan of a launch (overlap/plan.h): tests and benchmarks.
  m.def(
      "plan",
      [](int nranks, int rows, int n, int k, int avail, int cluster_ctas, int32_t mode, const std::string& kind) {
        using namespace dfccl::overlap;  // PlanLaunch refuses any other kind (-1)
        const int32_t kd = kind == "ag" ? kAllGatherGemm : kind == "rs" ? kGemmReduceScatter : -1;
        const LaunchPlan p = PlanLaunch(kd, nranks, rows, n, k, avail, cluster_ctas, mode);
        nb::dict d;
        d["tile_n"] = p.tile_n; d["cluster_m"] = p.cluster_m; d["tiles"] = p.tiles; d["units"] = p.units;
        d["sk_units"] = p.sk_units; d["sk_tiles"] = p.sk_tiles; d["grid"] = p.grid; d["pdl"] = p.pdl;
        d["m_fast"] = p.raster.m_fast; d["group_n"] = p.raster.group_n; d["tma_store"] = p.tma_store;
        d["pingpong"] = p.pingpong;
        return d;
      },
      nb::arg("nranks"), nb::arg("rows"), nb::arg("n"), nb::arg("k"), nb::arg("avail"), nb::arg("cluster_ctas"),
      nb::arg("mode"), nb::arg("kind"));

  // Diagnostics (benchmarks/overlap_diag.py); see handlers.h.
  m.def("_set_diag", &dfccl::overlap::SetDiag, nb::arg("no_comm"), nb::arg("profile"));
  m.def("_profile_results", [] {
    nb::list out;
    for (auto& [k, ms] : dfccl::overlap::ProfileResults()) out.append(nb::make_tuple(nb::str(k.c_str()), ms));
    return out;
  });
}
