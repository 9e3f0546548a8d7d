// The GPU host runtime's facade: the entry points of the FFI handlers
// (ffi/cuda_handlers.cc) and of the module's functions (bindings/cuda_module.cc).
// It owns the shared context (context.h: the lock, the configuration, the
// devices, the communicators), the three paths and the proxy thread:
//
// Daemon path (every collective below the copy-engine sizes, daemon_path.h):
// one kernel launch per call after a call site's first, matched on the device.
// Copy-engine path (the *_host targets, copy_engine_path.h): matched on the
// host, moved by the mover thread (runtime/copy_engine.h).
// Fused-op path (the dfccl_overlap_* targets, overlap_path.h): fused
// GEMM+communication kernels that synchronize the ranks themselves; the host
// keeps their channels, counts and deadline.
// Communicator (communicator.h): a group's memory, set-up, exchange across
// processes and the failure record of its instances, for every path.
// Proxy (proxy.h): completions, the daemon's (re)launch, the watchdog (all three paths).
//
// Lock: the facade's own functions take Context::mu themselves (configure,
// stats, trace, reset, the exchange across processes; pending() only tries it);
// the handlers call the paths, which take it as they need (Submit and Finish not
// at all on the hot path).  The module releases the GIL around every call that
// may take it (bindings/cuda_module.cc).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dfccl/collective.h"
#include "runtime/communicator.h"
#include "runtime/config.h"
#include "runtime/context.h"
#include "runtime/copy_engine_path.h"
#include "runtime/daemon_path.h"
#include "runtime/overlap_path.h"
#include "runtime/proxy.h"

namespace dfccl::gpu {

struct TraceOut {
  int device;
  std::string key;
  uint64_t seq;
  std::string event;
  uint64_t t_ns;
};

class Runtime {
 public:
  static Runtime& Get();
  ~Runtime();

  // The handlers' paths (their functions throw dfccl::Error; the FFI boundary,
  // ffi/error.h, converts it): the daemon path (Prepare, Submit, Finish) and the
  // copy-engine path (StartHost, DoneHost: the *_host targets, matched on the host),
  // the fused-op path (Begin, Commit: the dfccl_overlap_* targets).
  DaemonPath& daemon() { return daemon_; }
  CopyEnginePath& copy_engine() { return ce_path_; }
  OverlapPath& overlap() { return overlap_; }
  // Across processes (jax_dfccl.initialize): global device id <-> local ordinal, and a
  // group's memory exchanged by CUDA IPC (Python moves the blobs through the KV store).
  void SetDeviceIds(const std::vector<std::pair<int64_t, int>>& ids);
  // The daemon over another engine (device/daemon.h: _dfccl_nvshmem's, by its
  // address), before this process's first GPU is set up; its name.
  void SetDaemonEngine(uintptr_t engine);
  std::string DaemonEngineName();
  // The devices of a process that stopped answering or exited (global ids) and what was
  // seen: pending instances with a rank there fail naming it (Proxy::CheckPeersAlive).
  void SetLostDevices(const std::vector<int64_t>& ids, const std::string& why);
  int64_t GlobalOf(int ordinal) const { return ctx_.GlobalOf(ordinal); }
  // spans_hosts: its ranks are on more than one host (protocol "announce").
  // hosts: each rank's host (spanning hosts); latency_ns: a test setting, each put to a
  // rank of another host delayed by it (config.testing.cross_host_latency_us).
  std::string ExportComm(const std::vector<int64_t>& group, int rank, bool spans_hosts = false,
                         const std::vector<int32_t>& hosts = {}, uint64_t latency_ns = 0);
  // The direct path across processes (runtime/ipc.h): this process listens at `name`
  // (jax_dfccl.initialize, once every local GPU's XLA memory was found exportable).
  void StartIpc(const std::string& name);
  static std::string CanExport(int ordinal, const void* p);
  void ImportComm(const std::vector<int64_t>& group, const std::vector<std::string>& blobs);
  // Whether a collective of these sizes takes the copy-engine path (Python picks the target at lowering).
  bool UsesCopyEngine(OpKind kind, int nranks, int64_t in_bytes, int64_t out_bytes);
  // The entries of jax_dfccl.config this runtime holds (module function config()).
  Config config();

  void Configure(const std::map<std::string, double>& kv);
  HostTimes& host_times() { return ctx_.times; }
  std::map<std::string, double> Stats(std::vector<std::string>* errors);
  std::vector<TraceOut> Trace();
  // Collectives in flight, per device and path (runtime/inspect.cc); tries the lock for wait_ms.
  std::string Pending(int wait_ms);
  void Reset();
  // Looks at every device's completions now and throws a recorded failure
  // (jax_dfccl.raise_if_failed: outside command buffers a failure otherwise
  // reaches Python at the device's next collective call).
  void RaiseIfFailed();

 private:
  Runtime();

  Context ctx_;
  CopyEnginePath ce_path_{ctx_};
  DaemonPath daemon_{ctx_, proxy_};  // (proxy_ is bound here, used once the runtime is built)
  OverlapPath overlap_{ctx_};
  Proxy proxy_{ctx_, daemon_, ce_path_, overlap_};
};

}  // namespace dfccl::gpu
