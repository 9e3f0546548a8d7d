// nanobind module _dfccl_cpu: the extension-module contract of
// docs/architecture.md for the CPU backend.
#include <nanobind/nanobind.h>

#include "bindings/errors.h"
#include "bindings/tables.h"
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <string>
#include <vector>

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

// configure(cfg): every entry of cfg this runtime knows (jax_dfccl.config
// names; bool, int and float values), the others ignored.
void Configure(nb::dict cfg) {
  std::map<std::string, double> kv;
  for (auto [k, v] : cfg) {
    if (!nb::isinstance<nb::str>(k)) continue;
    if (nb::isinstance<nb::bool_>(v) || nb::isinstance<nb::int_>(v) || nb::isinstance<nb::float_>(v))
      kv[nb::cast<std::string>(k)] = nb::cast<double>(v);
  }
  GetConfig().Apply(kv);
}

// config(): the values this runtime uses, typed as jax_dfccl.config's.
nb::dict ConfigValues() {
  nb::dict d;
  const Config& c = GetConfig();
#define DFCCL_CPU_CONFIG_OUT(T, name) d[#name] = static_cast<T>(c.name.load());
  DFCCL_CPU_CONFIG(DFCCL_CPU_CONFIG_OUT)
#undef DFCCL_CPU_CONFIG_OUT
  return d;
}

// stats(): the keys of the table in docs/architecture.md ("stats() keys"):
// the common ones first, then this backend's extras.
nb::dict Stats() {
  StatsSnapshot s;
  std::vector<std::string> errors;
  {
    nb::gil_scoped_release r;
    s = GetStats();
    errors = RecentErrors();
  }
  nb::dict d;
  d["started"] = s.started;
  d["completed"] = s.completed;
  d["failed"] = s.failed;
  d["pending"] = s.pending;
  d["preemptions"] = s.preemptions;
  d["resumes"] = s.resumes;
  d["communicators"] = s.communicators;
  d["instances_live"] = s.instances_live;
  d["trace_records"] = s.trace_records;
  nb::list errs;
  for (const std::string& e : errors) errs.append(nb::str(e.data(), e.size()));
  d["errors"] = errs;
  // CPU extras
  d["daemon_threads"] = s.daemon_threads;
  d["key_counters"] = s.key_counters;
  d["tickets"] = s.tickets;
  d["tombstones"] = s.tombstones;
  d["staging_bytes"] = s.staging_bytes;
  d["staging_pool_bytes"] = s.staging_pool_bytes;
  const ShmStats m = GetShmStats();  // the runtime across processes (multiprocess.h)
  d["shm_process"] = m.process;
  d["shm_processes"] = m.processes;
  d["shm_live_entries"] = m.live_entries;
  d["shm_staged_bytes"] = m.staged_bytes;
  d["shm_arena_bytes"] = m.arena_bytes;
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
  m.def("op_table", &dfccl::bindings::OpTable, "The op, reduce-op and dtype tables (ids)");
  m.def("registrations", &Registrations, "FFI handler capsules by target name");
  // dfccl::Error out of a module function: ValueError for an invalid value, else RuntimeError.
  dfccl::RegisterErrorTranslator();  // bindings/errors.h
  m.def("configure", &Configure, nb::arg("cfg"), "Apply jax_dfccl.config entries (unknown keys ignored)");
  m.def("config", &ConfigValues, "The jax_dfccl.config entries this runtime uses, as it holds them");
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
  m.def("raise_if_failed", [] {}, "Nothing to raise: a failed CPU collective fails its own program");
  m.def("reset", [] {
    nb::gil_scoped_release r;
    Reset();
  }, "Fail open instances and drop completed/failed state");
}
