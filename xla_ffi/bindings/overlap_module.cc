// nanobind module _dfccl_overlap: the fused GEMM+communication overlap ops
// (tile-wise signaling Hopper GEMM, CUTLASS 3 sm90 mainloop), CUDA only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <optional>
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

  // The collectives' contract (docs/architecture.md), for what the fused ops
  // add to the CUDA backend: jax_dfccl/_src/backend.py merges it.
  m.def("configure", [](nb::dict cfg) {
    auto get = [&](const char* k) { return cfg.contains(k) ? nb::object(cfg[k]) : nb::object(); };
    std::optional<double> timeout_s;
    std::optional<bool> trace;
    std::optional<int64_t> capacity;
    if (auto v = get("timeout_s"); v.is_valid()) timeout_s = nb::cast<double>(v);
    if (auto v = get("trace"); v.is_valid()) trace = nb::cast<bool>(v);
    if (auto v = get("trace_capacity"); v.is_valid()) capacity = nb::cast<int64_t>(v);
    dfccl::overlap::Configure(timeout_s, trace, capacity);
  }, nb::arg("cfg"), "Apply jax_dfccl.config entries (timeout_s, trace, trace_capacity; others ignored)");
  m.def("config", [] {
    const auto c = dfccl::overlap::Config();
    nb::dict d;
    d["timeout_s"] = c.timeout_s;
    d["trace"] = c.trace;
    d["trace_capacity"] = c.trace_capacity;
    return d;
  });
  m.def("stats", [] {
    dfccl::overlap::Stats s;
    {
      nb::gil_scoped_release nogil;
      s = dfccl::overlap::GetStats();
    }
    nb::dict d;
    d["started"] = s.started; d["completed"] = s.completed; d["failed"] = s.failed;
    d["pending"] = static_cast<int64_t>(s.started) - static_cast<int64_t>(s.completed + s.failed);
    d["instances_live"] = s.instances_live; d["trace_records"] = s.trace_records; d["channels"] = s.channels;
    nb::list errs;
    for (auto& e : s.errors) errs.append(nb::str(e.c_str()));
    d["errors"] = errs;
    return d;
  });
  m.def("trace_records", [] {
    std::vector<dfccl::overlap::TraceRecord> recs;
    {
      nb::gil_scoped_release nogil;
      recs = dfccl::overlap::TraceRecords();
    }
    nb::list out;
    for (auto& r : recs) out.append(nb::make_tuple(r.device, nb::str(r.key.c_str()), r.seq, nb::str(r.event), r.t_ns));
    return out;
  });
  m.def("pending", [](int wait_ms) { return dfccl::overlap::Pending(wait_ms); }, nb::arg("wait_ms") = 1000,
        nb::call_guard<nb::gil_scoped_release>());
  m.def("raise_if_failed", &dfccl::overlap::RaiseIfFailed, nb::call_guard<nb::gil_scoped_release>());
  m.def("reset", &dfccl::overlap::Reset, nb::call_guard<nb::gil_scoped_release>());

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
