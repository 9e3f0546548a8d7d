// nanobind module _dfccl_cuda: the extension-module contract of
// docs/architecture.md (registrations, configure, stats, trace_records, reset),
// and, when built with CUTLASS (DFCCL_HAS_OVERLAP; attribute has_overlap), the
// fused overlap ops' targets (ffi/overlap_handlers.h) and their plan and
// diagnostics functions.
// Every function that takes the runtime's lock releases the GIL while it runs in
// the runtime: the lock may be held by a thread inside a CUDA call that waits for
// the device (the proxy relaunching the daemon, a handler's first call), and a
// caller holding the GIL meanwhile would stop every Python thread, the one that
// could report it (jax_dfccl.pending()) included.  Python objects are made with
// the GIL held, outside those sections.
#include <nanobind/nanobind.h>

#include "bindings/errors.h"
#include "bindings/tables.h"
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include "ffi/cuda_handlers.h"
#include "runtime/communicator.h"
#include "runtime/runtime.h"
#ifdef DFCCL_HAS_OVERLAP
#include "ffi/overlap_handlers.h"
#include "overlap/plan.h"
#include "overlap/profile.h"
#endif

namespace nb = nanobind;
using dfccl::gpu::Runtime;

namespace {
// f() (a call into the runtime) with the GIL released; its C++ result is
// turned into Python objects by the caller, with the GIL held again.
template <class F>
auto WithoutGil(F&& f) {
  nb::gil_scoped_release nogil;
  return f();
}
}  // namespace

NB_MODULE(_dfccl_cuda, m) {
  m.doc() = "jax_dfccl CUDA backend: daemon-kernel collectives as XLA FFI custom calls";

  m.def("op_table", &dfccl::bindings::OpTable, "The op, reduce-op and dtype tables (ids)");
  m.def("registrations", [] {
    nb::dict d;  // the one table of FFI targets
    d["dfccl_start"] = nb::capsule(reinterpret_cast<void*>(&dfccl::gpu::DfcclStartCuda));
    d["dfccl_done"] = nb::capsule(reinterpret_cast<void*>(&dfccl::gpu::DfcclDoneCuda));
    d["dfccl_collective"] = nb::capsule(reinterpret_cast<void*>(&dfccl::gpu::DfcclCollectiveCuda));
    // Groups spanning processes: the same handlers with an instantiate and an initialize
    // stage (protocol "run" in device/task.h; a dict of stages), chosen at lowering (core.py).
    auto with_stages = [](void* execute) {
      nb::dict st;
      st["instantiate"] = nb::capsule(reinterpret_cast<void*>(&dfccl::gpu::DfcclInstantiateCuda));
      st["initialize"] = nb::capsule(reinterpret_cast<void*>(&dfccl::gpu::DfcclInitializeCuda));
      st["execute"] = nb::capsule(execute);
      return st;
    };
    d["dfccl_start_x"] = with_stages(reinterpret_cast<void*>(&dfccl::gpu::DfcclStartCuda));
    d["dfccl_collective_x"] = with_stages(reinterpret_cast<void*>(&dfccl::gpu::DfcclCollectiveCuda));
    d["dfccl_start_host"] = nb::capsule(reinterpret_cast<void*>(&dfccl::gpu::DfcclStartHostCuda));
    d["dfccl_done_host"] = nb::capsule(reinterpret_cast<void*>(&dfccl::gpu::DfcclDoneHostCuda));
    d["dfccl_collective_host"] = nb::capsule(reinterpret_cast<void*>(&dfccl::gpu::DfcclCollectiveHostCuda));
#ifdef DFCCL_HAS_OVERLAP
    // The fused overlap ops (runtime/overlap_path.h): registered by
    // jax_dfccl._src.overlap_gpu where the GPUs are sm90.
    d["dfccl_overlap_ag"] = nb::capsule(reinterpret_cast<void*>(&dfccl::overlap::OverlapAgCuda));
    d["dfccl_overlap_rs"] = nb::capsule(reinterpret_cast<void*>(&dfccl::overlap::OverlapRsCuda));
#endif
    return d;
  });
  m.def("types", [] {
    nb::dict d;  // the FFI types of the targets' states (registered before the targets)
    nb::dict x;
    x["type_id"] = nb::capsule(dfccl::gpu::XSiteTypeId());
    x["type_info"] = nb::capsule(dfccl::gpu::XSiteTypeInfo());
    d["dfccl_x_site"] = x;
    return d;
  });
  m.def("set_device_ids", [](std::vector<std::pair<int64_t, int>> ids) { Runtime::Get().SetDeviceIds(ids); },
        nb::arg("ids"), nb::call_guard<nb::gil_scoped_release>(),
        "(global device id, local CUDA ordinal) of this process's GPUs (jax_dfccl.initialize)");
  m.def("set_daemon_engine", [](uintptr_t engine) { Runtime::Get().SetDaemonEngine(engine); }, nb::arg("engine"),
        nb::call_guard<nb::gil_scoped_release>(),
        "The daemon over another engine (_dfccl_nvshmem.daemon_engine()), before the first collective on a GPU");
  m.def("set_lost_devices", [](std::vector<int64_t> ids, std::string why) { Runtime::Get().SetLostDevices(ids, why); },
        nb::arg("ids"), nb::arg("why"), nb::call_guard<nb::gil_scoped_release>(),
        "The devices (global ids) of a process the job lost, and what was seen (jax_dfccl.initialize's "
        "liveness watch): pending collectives with a rank there fail naming it");
  m.def("daemon_engine", [] { return Runtime::Get().DaemonEngineName(); }, nb::call_guard<nb::gil_scoped_release>(),
        "The daemon's engine under groups spanning hosts: 'stores' (CUDA IPC) or 'nvshmem'");
  m.def("announce_max_bytes", &dfccl::gpu::Communicator::AnnounceMaxBytes,
        "The largest input of a rank of a group spanning hosts (a receive slot's section)");
  m.def("comm_export", [](std::vector<int64_t> group, int rank, bool spans_hosts, std::vector<int32_t> hosts,
                          double latency_us) {
    DFCCL_CHECK(latency_us >= 0 && latency_us < 1e6, "dfccl: a simulated latency in [0, 1 s)");
    const std::string b = WithoutGil([&] {
      return Runtime::Get().ExportComm(group, rank, spans_hosts, hosts, static_cast<uint64_t>(latency_us * 1e3));
    });
    return nb::bytes(b.data(), b.size());
  }, nb::arg("group"), nb::arg("rank"), nb::arg("spans_hosts") = false, nb::arg("hosts") = std::vector<int32_t>{},
  nb::arg("latency_us") = 0.0,
  "Allocates a local rank's memory of a group spanning processes; its CUDA IPC handles.  spans_hosts: "
  "its ranks are on several hosts (matched by announcements, docs/design/announce.md), `hosts` each rank's; "
  "latency_us: a test setting, each put to a rank of another host delayed by it");
  m.def("start_ipc", [](std::string name) { WithoutGil([&] { Runtime::Get().StartIpc(name); }); }, nb::arg("name"),
        "Listens at the abstract Unix socket `name` for the other processes' allocations: the direct path "
        "across processes (runtime/ipc.h)");
  m.def("can_export", [](int ordinal, uint64_t ptr) {
    return WithoutGil([&] { return Runtime::CanExport(ordinal, reinterpret_cast<const void*>(ptr)); });
  }, nb::arg("ordinal"), nb::arg("ptr"),
  "'' if the allocation holding device pointer ptr (an XLA buffer on GPU `ordinal`) can be shared with "
  "another process, else why not");
  m.def("comm_import", [](std::vector<int64_t> group, std::vector<nb::bytes> blobs) {
    std::vector<std::string> v;
    for (auto& b : blobs) v.emplace_back(b.c_str(), b.size());
    WithoutGil([&] { Runtime::Get().ImportComm(group, v); });
  }, nb::arg("group"), nb::arg("blobs"), "Maps the other processes' ranks of the group (one blob per rank)");
  m.def("uses_copy_engine", [](int kind, int nranks, int64_t in_bytes, int64_t out_bytes) {
    return Runtime::Get().UsesCopyEngine(static_cast<dfccl::OpKind>(kind), nranks, in_bytes, out_bytes);
  }, nb::arg("kind"), nb::arg("nranks"), nb::arg("in_bytes"), nb::arg("out_bytes"), nb::call_guard<nb::gil_scoped_release>(),
  "Whether a collective of these per-rank sizes takes the copy-engine path (the *_host targets), "
  "by the runtime's configuration");

  dfccl::RegisterErrorTranslator();  // bindings/errors.h

  m.def("configure", [](nb::dict cfg) {
    std::map<std::string, double> kv;
    for (auto [k, v] : cfg) {
      if (!nb::isinstance<nb::str>(k)) continue;
      if (nb::isinstance<nb::bool_>(v) || nb::isinstance<nb::int_>(v) || nb::isinstance<nb::float_>(v))
        kv[nb::cast<std::string>(k)] = nb::cast<double>(v);
    }
    WithoutGil([&] { Runtime::Get().Configure(kv); });
  }, "Apply jax_dfccl.config entries (unknown keys ignored; every entry before the first collective)");

  m.def("config", [] {  // the values the runtime holds, typed as jax_dfccl.config's
    nb::dict d;
    WithoutGil([] { return Runtime::Get().config(); }).ForEach([&](const char* name, const auto& v) { d[name] = v; });
    return d;
  }, "The jax_dfccl.config entries this runtime uses, as it holds them");

  m.def("stats", [] {
    std::vector<std::string> errors;
    const auto s = WithoutGil([&] { return Runtime::Get().Stats(&errors); });
    nb::dict d;
    for (auto& [k, v] : s) {  // host_*_us and copy_engine_*_us are means / totals in us, the rest counts
      if (k.size() > 3 && k.compare(k.size() - 3, 3, "_us") == 0) d[k.c_str()] = v;
      else d[k.c_str()] = static_cast<int64_t>(v);
    }
    nb::list errs;
    for (auto& e : errors) errs.append(nb::str(e.c_str()));
    d["errors"] = errs;
    return d;
  });

  m.def("trace_records", [] {
    nb::list out;
    for (auto& r : WithoutGil([] { return Runtime::Get().Trace(); }))
      out.append(nb::make_tuple(r.device, r.key, r.seq, r.event, r.t_ns));
    return out;
  });

  m.def("reset", [] { Runtime::Get().Reset(); }, nb::call_guard<nb::gil_scoped_release>());
  m.def("raise_if_failed", [] { Runtime::Get().RaiseIfFailed(); }, nb::call_guard<nb::gil_scoped_release>(),
        "Raise a collective failure recorded for a local GPU (once; a CUDA error every time)");

  m.def("pending", [](int wait_ms) { return Runtime::Get().Pending(wait_ms); }, nb::arg("wait_ms") = 1000,
        nb::call_guard<nb::gil_scoped_release>(), "Report of the collectives in flight");

#ifdef DFCCL_HAS_OVERLAP
  m.attr("has_overlap") = true;
  // The plan of a fused launch (overlap/plan.h): tests and benchmarks.
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
  // Diagnostics of the fused ops (benchmarks/overlap_diag.py; overlap/profile.h).
  m.def("_set_diag", &dfccl::overlap::SetDiag, nb::arg("no_comm"), nb::arg("profile"));
  m.def("_profile_results", [] {
    nb::list out;
    for (auto& [k, ms] : dfccl::overlap::ProfileResults()) out.append(nb::make_tuple(nb::str(k.c_str()), ms));
    return out;
  });
#else
  m.attr("has_overlap") = false;  // built without CUTLASS: no fused overlap ops
#endif
}
