// nanobind module _dfccl_cpu: the extension-module contract of
// docs/architecture.md for the CPU backend.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "cpu/handlers.h"
#include "cpu/multiprocess.h"
#include "cpu/shm.h"
#include "cpu/runtime.h"

namespace nb = nanobind;
using namespace dfccl::cpu;

namespace {

nb::dict Registrations() {
  nb::dict d;
  d["dfccl_start"] = nb::capsule(reinterpret_cast<void*>(DfcclCpuStart));
  d["dfccl_done"] = nb::capsule(reinterpret_cast<void*>(DfcclCpuDone));
  return d;
}

void Configure(nb::dict cfg) {
  Config& c = GetConfig();
  for (auto [k, v] : cfg) {
    if (!nb::isinstance<nb::str>(k)) continue;
    const std::string key = nb::cast<std::string>(k);
    auto as_double = [&](const char* name) {
      double x = nb::cast<double>(v);
      if (!(x > 0)) throw nb::value_error((std::string("dfccl: ") + name + " must be > 0").c_str());
      return x;
    };
    if (key == "timeout_s") {
      c.timeout_s = as_double("timeout_s");
    } else if (key == "spin_budget_us") {
      c.spin_budget_us = as_double("spin_budget_us");
    } else if (key == "sticky_budget_us") {
      c.sticky_budget_us = as_double("sticky_budget_us");
    } else if (key == "trace") {
      int b = PyObject_IsTrue(v.ptr());
      if (b < 0) throw nb::python_error();
      c.trace = b != 0;
    } else if (key == "trace_capacity") {
      int64_t cap = nb::cast<int64_t>(v);
      if (cap < 1) throw nb::value_error("dfccl: trace_capacity must be >= 1");
      c.trace_capacity = cap;
    }  // unknown entries are ignored (they belong to other backends)
  }
}

nb::dict Stats() {
  StatsSnapshot s;
  {
    nb::gil_scoped_release r;
    s = GetStats();
  }
  nb::dict d;
  d["started"] = s.started;
  d["completed"] = s.completed;
  d["failed"] = s.failed;
  d["preemptions"] = s.preemptions;
  d["resumes"] = s.resumes;
  d["pending"] = s.pending;
  d["daemon_threads"] = s.daemon_threads;
  d["communicators"] = s.communicators;
  d["instances_live"] = s.instances_live;
  d["key_counters"] = s.key_counters;
  d["trace_records"] = s.trace_records;
  d["tickets"] = s.tickets;
  const ShmStats m = GetShmStats();  // the runtime across processes (multiprocess.h)
  d["shm_process"] = m.process;
  d["shm_processes"] = m.processes;
  d["shm_live_entries"] = m.live_entries;
  d["shm_staged_bytes"] = m.staged_bytes;
  d["shm_arena_bytes"] = m.arena_bytes;
  Config& c = GetConfig();
  d["timeout_s"] = c.timeout_s.load();
  d["spin_budget_us"] = c.spin_budget_us.load();
  d["sticky_budget_us"] = c.sticky_budget_us.load();
  d["trace"] = c.trace.load();
  return d;
}

nb::list TraceRecords() {
  std::vector<TraceRecord> recs;
  {
    nb::gil_scoped_release r;
    recs = TraceSnapshot();
  }
  nb::list out;
  for (const TraceRecord& t : recs)
    out.append(nb::make_tuple(t.device, nb::str(t.key.data(), t.key.size()), t.seq, nb::str(t.event), t.t_ns));
  return out;
}

}  // namespace

NB_MODULE(_dfccl_cpu, m) {
  m.doc() = "jax_dfccl CPU backend: deadlock-free, order-free collectives on host threads";
  m.def("registrations", &Registrations, "FFI handler capsules by target name");
  m.def("configure", &Configure, nb::arg("cfg"), "Apply jax_dfccl.config entries (unknown keys ignored)");
  m.def("stats", &Stats, "Runtime counters");
  m.def("trace_records", &TraceRecords, "(device, key, seq, event, t_ns) from the trace ring buffer");
  m.def("pending", [](int /*wait_ms*/) { return PendingReport(); }, nb::arg("wait_ms") = 1000,
        nb::call_guard<nb::gil_scoped_release>(), "Report of the collectives in flight");
  // Bootstrap across processes (jax_dfccl/_src/distributed.py); see multiprocess.h.
  m.def("shm_control_bytes", &ShmControlBytes, nb::arg("entries"));
  m.def("shm_create", &ShmCreate, nb::arg("name"), nb::arg("bytes"), nb::arg("control"), nb::arg("nprocs"),
        nb::arg("entries"), "Create and map a segment of this process (control segment or arena)");
  m.def("shm_attach", &ShmAttach, nb::arg("control"), nb::arg("arenas"), nb::arg("process"),
        nb::arg("device_procs"), nb::call_guard<nb::gil_scoped_release>(),
        "Map the peers' segments and register this process");
  m.def("shm_detach", &ShmDetach, "Mark this process as exited in the process table");
  m.def("shm_unlink", [](const std::string& name) { dfccl::shm::UnlinkSegment(name); }, nb::arg("name"));
  m.def("shm_sweep", [] { return dfccl::shm::SweepDeadSegments(); },
        "Remove /dev/shm/dfccl.<pid>.* segments of dead creators; returns how many");
  m.def("reset", [] {
    nb::gil_scoped_release r;
    Reset();
  }, "Fail open instances and drop completed/failed state");
}
