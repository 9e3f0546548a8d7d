// nanobind module _dfccl_nvshmem: NVSHMEM as the engine under the cross-host
// transport (transport/nvshmem_engine.h): its version, the unique-id bootstrap
// (jax_dfccl/_src/nvshmem.py carries the id through the job's key-value store),
// and the transport check.  Built only where NVSHMEM is found (CMakeLists.txt).
// Calls that wait for other PEs release the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings/errors.h"
#include "transport/nvshmem_engine.h"

namespace nb = nanobind;
namespace nv = dfccl::nvshm;

NB_MODULE(_dfccl_nvshmem, m) {
  m.doc() = "jax_dfccl: NVSHMEM under the cross-host transport (set-up, the daemon over NVSHMEM, the transport check)";
  dfccl::RegisterErrorTranslator();
  m.def("built_version", &nv::BuiltVersion, "NVSHMEM version of the headers this module was built with");
  m.def("loaded_version", &nv::LoadedVersion, "NVSHMEM version of the host library loaded");
  m.def("unique_id", [] {
        const std::string id = nv::UniqueId();
        return nb::bytes(id.data(), id.size());
      },
        "PE 0's part of the bootstrap: NVSHMEM's unique id (128 bytes)");
  m.def(
      "init",
      [](nb::bytes uid, int rank, int nranks, int device) {
        const std::string id(uid.c_str(), uid.size());
        nb::gil_scoped_release nogil;
        return nv::Init(id, rank, nranks, device);
      },
      nb::arg("uid"), nb::arg("rank"), nb::arg("nranks"), nb::arg("device") = -1,
      "Joins the NVSHMEM job as `rank` of `nranks` (collective) on CUDA ordinal `device` (-1: the current "
      "one); returns the init status");
  m.def("finalize", [] {
    nb::gil_scoped_release nogil;
    nv::Finalize();
  });
  m.def("initialized", &nv::Initialized);
  m.def(
      "heap",
      [](uint64_t bytes) {
        nb::gil_scoped_release nogil;
        nv::Heap(bytes);
      },
      nb::arg("bytes"),
      "The symmetric allocation the daemon's groups spanning hosts take their regions from (collective)");
  m.def("release_heap", [] {
    nb::gil_scoped_release nogil;
    nv::ReleaseHeap();
  });
  m.def("daemon_engine", &nv::DaemonEngineAddress,
        "The address of this module's daemon engine, for _dfccl_cuda.set_daemon_engine");
  m.def(
      "check",
      [](int blocks, int per_block, int msg_bytes, int slots, int mismatch_every, int pingpong, uint64_t seed,
         double timeout_s, bool store, int ranks_per_host, double delay_us) {
        nv::CheckSpec s;
        s.blocks = blocks;
        s.per_block = per_block;
        s.msg_bytes = msg_bytes;
        s.slots = slots;
        s.mismatch_every = mismatch_every;
        s.pingpong = pingpong;
        s.seed = seed;
        s.timeout_s = timeout_s;
        s.store = store;
        s.ranks_per_host = ranks_per_host;
        s.delay_us = delay_us;
        std::vector<nv::CheckRun> runs;
        {
          nb::gil_scoped_release nogil;
          runs = nv::Check(s);
        }
        nb::list out;
        for (const nv::CheckRun& r : runs) {
          nb::dict d;
          d["transport"] = r.transport;
          d["skipped"] = r.skipped;
          d["ok"] = r.ok;
          d["failed_as_expected"] = r.failed_as_expected;
          d["wrong"] = r.wrong;
          d["cap_refused"] = r.cap_refused;
          d["first_error"] = r.first_error;
          d["seconds"] = r.seconds;
          d["round_trip_us"] = r.round_trip_us;
          out.append(d);
        }
        return out;
      },
      nb::arg("blocks") = 40, nb::arg("per_block") = 8, nb::arg("msg_bytes") = 64, nb::arg("slots") = 3,
      nb::arg("mismatch_every") = 5, nb::arg("pingpong") = 2000, nb::arg("seed") = 1, nb::arg("timeout_s") = 10.0,
      nb::arg("store") = true, nb::arg("ranks_per_host") = 0, nb::arg("delay_us") = 0.0,
      "Protocol C over each transport on every PE at once (collective): one dict per transport");
  m.def(
      "native",
      [](const std::string& op, std::vector<int64_t> bytes, int iters, int reps) {
        nv::NativeSpec s;
        s.op = op;
        s.bytes = std::move(bytes);
        s.iters = iters;
        s.reps = reps;
        std::vector<nv::NativeRow> rows;
        {
          nb::gil_scoped_release nogil;
          rows = nv::Native(s);
        }
        nb::list out;
        for (const nv::NativeRow& r : rows) {
          nb::dict d;
          d["bytes"] = r.bytes;
          d["exact"] = r.exact;
          d["max_err"] = r.max_err;
          d["us"] = r.us;
          out.append(d);
        }
        return out;
      },
      nb::arg("op"), nb::arg("bytes"), nb::arg("iters") = 20, nb::arg("reps") = 5,
      "NVSHMEM's own collective `op` (psum, all_gather, all_to_all) on a stream, checked and timed (collective)");
}
