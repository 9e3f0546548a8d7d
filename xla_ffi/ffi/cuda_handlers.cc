// The CUDA FFI handlers.  Daemon path (dfccl_start, dfccl_done,
// dfccl_collective): after a call site's first call, each enqueues one kernel
// whose parameters say everything (runtime/daemon_path.h), so they declare
// kCmdBufferCompatible and XLA captures them into command buffers.  Copy-engine
// path (dfccl_start_host, dfccl_done_host, dfccl_collective_host; chosen by
// core.py at lowering for the sizes the runtime's UsesCopyEngine names): host
// matching and stream memory operations on every call, so no such trait.  The
// host never blocks here.
#include "ffi/cuda_handlers.h"

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>

#include "ffi/attrs.h"
#include "ffi/error.h"
#include "runtime/runtime.h"

namespace ffi = xla::ffi;

namespace dfccl::gpu {
namespace {

// The rank's partition id, from the device XLA runs this call on (the
// partition-id operand lives in device memory and cannot be read at enqueue time).
int32_t PartitionOf(const StartAttrs& a, int32_t ordinal) {
  const int64_t self = Runtime::Get().GlobalOf(ordinal);
  for (size_t p = 0; p < a.device_ids.size(); ++p)
    if (a.device_ids[p] == self) return static_cast<int32_t>(p);
  return -1;
}

// Parsed specs per call site, per XLA device thread (attributes of a site never
// change, so the decoding and the signature are built once).
struct SpecKey {
  int64_t site, key_hash, elems;
  int32_t ordinal, dtype;
  bool operator==(const SpecKey& o) const {
    return site == o.site && key_hash == o.key_hash && elems == o.elems && ordinal == o.ordinal && dtype == o.dtype;
  }
};
struct SpecKeyHash {
  size_t operator()(const SpecKey& k) const {
    return std::hash<int64_t>()(k.site * 1000003 ^ k.key_hash ^ (k.elems << 7) ^ (int64_t{k.ordinal} << 40) ^ k.dtype);
  }
};
struct Parsed {
  CollectiveSpec spec;
  std::string signature;
  const Site* site = nullptr;  // daemon path: set up at the first call
};

// Times one handler call into HostTimes; the gap since this thread's previous
// call counts when it is short (the same program's per-op work, not idle time).
class HandlerTimer {
 public:
  HandlerTimer(std::atomic<int64_t>& ns, std::atomic<int64_t>& count) : ns_(ns), count_(count), t0_(Clock::now()) {
    HostTimes& h = Runtime::Get().host_times();
    const auto gap = std::chrono::duration_cast<std::chrono::nanoseconds>(t0_ - last_exit_).count();
    if (gap > 0 && gap < 200000) { h.gap_ns += gap; h.gaps++; }
  }
  ~HandlerTimer() {
    last_exit_ = Clock::now();
    ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(last_exit_ - t0_).count();
    count_++;
  }
 private:
  static thread_local Clock::time_point last_exit_;
  std::atomic<int64_t>& ns_;
  std::atomic<int64_t>& count_;
  Clock::time_point t0_;
};
thread_local Clock::time_point HandlerTimer::last_exit_{};

// The parsed spec of this call site on this device (built at its first call).
Parsed& SpecOf(int32_t ordinal, const ffi::AnyBuffer& x, int64_t out_elems, const StartAttrs& attrs) {
  thread_local std::unordered_map<SpecKey, Parsed, SpecKeyHash> cache;
  const SpecKey k{attrs.site, attrs.key_hash, static_cast<int64_t>(x.element_count()), ordinal,
                  static_cast<int32_t>(x.element_type())};
  auto it = cache.find(k);
  if (it != cache.end()) return it->second;
  const int32_t pid = PartitionOf(attrs, ordinal);
  DFCCL_CHECK(pid >= 0, "dfccl: GPU " << ordinal << " is not in collective '" << attrs.key << "'");
  Parsed p;
  p.spec = ParseSpec(attrs, pid, x.element_type(), static_cast<int64_t>(x.element_count()), out_elems);
  p.signature = p.spec.Signature();
  return cache.emplace(k, std::move(p)).first->second;
}

// `init` (ragged_all_to_all): the caller's output values, aliased to out; when
// XLA did not alias them, copied into out in stream order before the start.
void CopyInit(cudaStream_t stream, const std::optional<ffi::AnyBuffer>& init, ffi::AnyBuffer& out_buf) {
  void* out = out_buf.untyped_data();
  if (init.has_value() && init->untyped_data() != out && init->size_bytes() > 0) {
    DFCCL_CHECK(init->size_bytes() == out_buf.size_bytes(), "dfccl: init does not match the result");
    DFCCL_CHECK_CUDA(cudaMemcpyAsync(out, init->untyped_data(), init->size_bytes(), cudaMemcpyDeviceToDevice, stream),
                     "dfccl: copy of init");
  }
}

// A start form's staged site (device/task.h, "staged"), found by its done: by
// device, the start's site id and its operand's shape (what the done's x_alias has).
struct StagedKey {
  int64_t site, elems;
  int32_t ordinal, dtype;
  bool operator<(const StagedKey& o) const {
    return std::tie(site, elems, ordinal, dtype) < std::tie(o.site, o.elems, o.ordinal, o.dtype);
  }
};
std::mutex& staged_mu = *new std::mutex;
auto& staged_sites = *new std::map<StagedKey, const Site*>;

StagedKey StagedKeyOf(int32_t ordinal, int64_t site, const ffi::AnyBuffer& x) {
  return StagedKey{site, static_cast<int64_t>(x.element_count()), ordinal, static_cast<int32_t>(x.element_type())};
}

// The execution's launch id (0: XLA without collective parameters, which says -1).
uint32_t RunOf(ffi::RunId run) { return run.run_id == -1 ? 0u : static_cast<uint32_t>(run.run_id); }

// Daemon path, both start forms: the submit kernel (blocking: it also waits); a
// start form's operand goes into its site's slot first (its task never touches
// XLA's buffers, so a program that stops before the done leaves nothing in use).
// `run`: the execution's launch id (protocol "run" in device/task.h).
ffi::Error Begin(cudaStream_t stream, int32_t ordinal, ffi::RunId run, const ffi::AnyBuffer& x,
                 const std::optional<ffi::AnyBuffer>& init, ffi::AnyBuffer& out_buf, int64_t* ticket,
                 const StartAttrs& attrs, bool blocking) {
  HostTimes& times = Runtime::Get().host_times();
  HandlerTimer timer(times.start_ns, times.starts);
  return FfiGuard([&] {
    Parsed& p = SpecOf(ordinal, x, static_cast<int64_t>(out_buf.element_count()), attrs);
    if (!p.site && blocking) p.site = Runtime::Get().daemon().Prepare(ordinal, p.spec, p.signature);
    if (!p.site) {  // a start form: one staged site per (device, start, operand shape), whichever thread calls; its done finds it
      std::lock_guard lk(staged_mu);
      const Site*& site = staged_sites[StagedKeyOf(ordinal, attrs.site, x)];
      if (!site)
        site = Runtime::Get().daemon().Prepare(ordinal, p.spec, p.signature, true, static_cast<int64_t>(x.size_bytes()),
                                      static_cast<int64_t>(out_buf.size_bytes()));
      p.site = site;
    }
    if (p.site->staged) {  // ragged_all_to_all's initial output goes into the slot too (the stage kernel)
      DFCCL_CHECK(!init.has_value() || init->size_bytes() == out_buf.size_bytes(), "dfccl: init does not match the result");
      Runtime::Get().daemon().Submit(stream, *p.site, x.untyped_data(), out_buf.untyped_data(), ticket, blocking,
                                     RunOf(run), init.has_value() ? init->untyped_data() : nullptr);
      return;
    }
    CopyInit(stream, init, out_buf);
    Runtime::Get().daemon().Submit(stream, *p.site, x.untyped_data(), out_buf.untyped_data(), ticket, blocking,
                                   RunOf(run));
  });
}

// The staged site of a done's start (every dfccl_start is staged; its handler ran first).
const Site& StagedSiteOf(int32_t ordinal, const DoneAttrs& attrs, const ffi::AnyBuffer& x_alias) {
  thread_local std::map<StagedKey, const Site*> cache;
  const StagedKey k = StagedKeyOf(ordinal, attrs.site, x_alias);
  auto it = cache.find(k);
  if (it != cache.end()) return *it->second;
  std::lock_guard lk(staged_mu);
  auto g = staged_sites.find(k);
  DFCCL_CHECK(g != staged_sites.end() && g->second != nullptr,
              "dfccl: the done of '" << attrs.key << "' on GPU " << ordinal << " has no start on this GPU");
  return *(cache[k] = g->second);
}

// Copy-engine path, both start forms.
ffi::Error BeginHost(cudaStream_t stream, int32_t ordinal, const ffi::AnyBuffer& x,
                     const std::optional<ffi::AnyBuffer>& init, ffi::AnyBuffer& out_buf, const StartAttrs& attrs,
                     bool blocking) {
  HostTimes& times = Runtime::Get().host_times();
  HandlerTimer timer(times.start_ns, times.starts);
  return FfiGuard([&] {
    const Parsed& p = SpecOf(ordinal, x, static_cast<int64_t>(out_buf.element_count()), attrs);
    CopyInit(stream, init, out_buf);
    Runtime::Get().copy_engine().StartHost(ordinal, stream, p.spec, p.signature, x.untyped_data(),
                                           out_buf.untyped_data(), blocking);
  });
}

// The submit kernel stores the ticket into the ticket buffer; done's kernel reads it.
ffi::Error StartImpl(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x,
                     ffi::AnyBuffer /*partition_id*/, std::optional<ffi::AnyBuffer> init, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> /*x_alias*/, ffi::Result<ffi::AnyBuffer> ticket, StartAttrs attrs) {
  return Begin(stream, ordinal, run, x, init, *out, static_cast<int64_t*>(ticket->untyped_data()), attrs, false);
}

ffi::Error CollectiveImpl(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x,
                          ffi::AnyBuffer /*partition_id*/, std::optional<ffi::AnyBuffer> init,
                          ffi::Result<ffi::AnyBuffer> out, StartAttrs attrs) {
  return Begin(stream, ordinal, run, x, init, *out, nullptr, attrs, true);
}

// The public done is not aliased (its handle may have other users: core.py): the result is copied after the wait.
void CopyResult(cudaStream_t stream, const ffi::AnyBuffer& out_in, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != out_in.untyped_data())
    DFCCL_CHECK_CUDA(cudaMemcpyAsync(out->untyped_data(), out_in.untyped_data(), out_in.size_bytes(),
                                     cudaMemcpyDeviceToDevice, stream),
                     "dfccl: copy of done result");
}

ffi::Error DoneImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer /*out_in*/, ffi::AnyBuffer x_alias,
                    ffi::AnyBuffer ticket, ffi::Result<ffi::AnyBuffer> out, DoneAttrs attrs) {
  HostTimes& times = Runtime::Get().host_times();
  HandlerTimer timer(times.done_ns, times.dones);
  return FfiGuard([&] {
    const Site& site = StagedSiteOf(ordinal, attrs, x_alias);
    DFCCL_CHECK(site.out_bytes == static_cast<int64_t>(out->size_bytes()),
                "dfccl: the done of '" << attrs.key << "' does not match its start's result");
    Runtime::Get().daemon().Finish(ordinal, stream, static_cast<const int64_t*>(ticket.untyped_data()), site,
                                   out->untyped_data());
  });
}

// What XLA's instantiate stage makes once per executable for a daemon-path start of
// a group spanning processes (targets dfccl_start_x, dfccl_collective_x): the
// attributes the initialize stage needs, decoded once, and per GPU the key's book
// (found at the site's first initialize on that GPU).  XLA shares one state between
// the devices that run the thunk (they may call concurrently).
struct XSite {
  static ffi::TypeId id;
  int32_t kind = 0, reduce_op = 0, group_size = 0;
  int64_t site = 0, key_hash = 0;
  std::string key;
  std::vector<int32_t> groups, perm;
  std::vector<int64_t> device_ids;
  static constexpr int kMaxOrdinals = DaemonPath::kMaxOrdinals;
  static constexpr uintptr_t kNoBook = 1;  // a group inside this process: nothing to book
  std::array<std::atomic<uintptr_t>, kMaxOrdinals> books{};  // 0: not looked up yet

  StartAttrs Attrs() const {
    return StartAttrs{kind, reduce_op, key, key_hash, site, group_size, ffi::Span<const int32_t>(groups),
                      ffi::Span<const int64_t>(device_ids), ffi::Span<const int32_t>(perm)};
  }
  KeyRuns* BookOf(int32_t ordinal) {
    DFCCL_CHECK(ordinal >= 0 && ordinal < kMaxOrdinals, "dfccl: GPU ordinal " << ordinal << " out of range");
    uintptr_t b = books[ordinal].load(std::memory_order_acquire);
    if (b == 0) {  // (two devices' threads may both look up: the runtime's lookup is idempotent)
      const StartAttrs a = Attrs();
      const int32_t pid = PartitionOf(a, ordinal);
      DFCCL_CHECK(pid >= 0, "dfccl: GPU " << ordinal << " is not in collective '" << key << "'");
      int32_t rank = 0;
      KeyRuns* kr = Runtime::Get().daemon().BookOf(ordinal, GroupOf(a, pid, &rank), static_cast<uint64_t>(key_hash));
      b = kr ? reinterpret_cast<uintptr_t>(kr) : kNoBook;
      books[ordinal].store(b, std::memory_order_release);
    }
    return b == kNoBook ? nullptr : reinterpret_cast<KeyRuns*>(b);
  }
};
ffi::TypeId XSite::id = {};
const XLA_FFI_TypeInfo kXSiteInfo = ffi::MakeTypeInfo<XSite>();

ffi::ErrorOr<std::unique_ptr<XSite>> InstantiateImpl(StartAttrs a) {
  auto st = std::make_unique<XSite>();
  st->kind = a.kind;
  st->reduce_op = a.reduce_op;
  st->group_size = a.group_size;
  st->site = a.site;
  st->key_hash = a.key_hash;
  st->key = std::string(a.key);
  st->groups.assign(a.groups.begin(), a.groups.end());
  st->perm.assign(a.perm.begin(), a.perm.end());
  st->device_ids.assign(a.device_ids.begin(), a.device_ids.end());
  return ffi::ErrorOr<std::unique_ptr<XSite>>(std::move(st));
}

// Their initialize stage: XLA calls it once per execution for every such start of
// the program, before any of its thunks runs (failed executions too), also for
// starts inside command buffers, with the execution's stream (not capturing)
// (measured: benchmarks/results/ffi_stages_2026-12-06_h100.json).  It opens the
// program's line of the key's book (protocol "run" in device/task.h) and, the
// execution's first on this GPU, writes its launch id on the stream for the starts
// XLA replays from command buffers.  No attributes are decoded here (the state
// holds them): this runs for every start of every execution.
ffi::Error InitializeImpl(XSite* st, cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::RemainingArgs,
                          ffi::RemainingRets) {
  return FfiGuard([&] {
    const uint32_t r = RunOf(run);
    if (r == 0) return;  // XLA without collective parameters: no launch id
    if (KeyRuns* book = st->BookOf(ordinal)) Runtime::Get().daemon().Plan(ordinal, *book, r, st->site);
    Runtime::Get().daemon().BeginExecution(ordinal, stream, r);
  });
}

// The ticket buffer stays unwritten on the copy-engine path: done pairs with
// start through the per-(device, site) FIFO (a device buffer cannot be read at enqueue time).
ffi::Error StartHostImpl(cudaStream_t stream, int32_t ordinal, ffi::RunId /*run*/, ffi::AnyBuffer x,
                         ffi::AnyBuffer /*partition_id*/,
                         std::optional<ffi::AnyBuffer> init, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> /*x_alias*/, ffi::Result<ffi::AnyBuffer> /*ticket*/,
                         StartAttrs attrs) {
  return BeginHost(stream, ordinal, x, init, *out, attrs, false);
}

ffi::Error CollectiveHostImpl(cudaStream_t stream, int32_t ordinal, ffi::RunId /*run*/, ffi::AnyBuffer x,
                              ffi::AnyBuffer /*partition_id*/,
                              std::optional<ffi::AnyBuffer> init, ffi::Result<ffi::AnyBuffer> out, StartAttrs attrs) {
  return BeginHost(stream, ordinal, x, init, *out, attrs, true);
}

ffi::Error DoneHostImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer out_in, ffi::AnyBuffer /*x_alias*/,
                        ffi::AnyBuffer /*ticket*/, ffi::Result<ffi::AnyBuffer> out, DoneAttrs attrs) {
  HostTimes& times = Runtime::Get().host_times();
  HandlerTimer timer(times.done_ns, times.dones);
  return FfiGuard([&] {
    Runtime::Get().copy_engine().DoneHost(ordinal, stream, attrs.site);
    CopyResult(stream, out_in, out);
  });
}

}  // namespace

// The blocking form's signature; the start form adds x_alias and the ticket.
#define DFCCL_COLLECTIVE_ARGS                                \
  ffi::Ffi::Bind()                                           \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()              \
      .Ctx<ffi::DeviceOrdinal>()                             \
      .Ctx<ffi::RunId>()               /* the execution */   \
      .Arg<ffi::AnyBuffer>()           /* x */               \
      .Arg<ffi::AnyBuffer>()           /* partition_id */    \
      .OptionalArg<ffi::AnyBuffer>()   /* init (aliased) */  \
      .Ret<ffi::AnyBuffer>()           /* out */
#define DFCCL_COLLECTIVE_BINDING DFCCL_COLLECTIVE_ARGS.Attrs<StartAttrs>()
#define DFCCL_START_BINDING                                  \
  DFCCL_COLLECTIVE_ARGS                                      \
      .Ret<ffi::AnyBuffer>()           /* x_alias */         \
      .Ret<ffi::AnyBuffer>()           /* ticket (s64[]) */  \
      .Attrs<StartAttrs>()
#define DFCCL_DONE_BINDING                                   \
  ffi::Ffi::Bind()                                           \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()              \
      .Ctx<ffi::DeviceOrdinal>()                             \
      .Arg<ffi::AnyBuffer>()           /* out (from start) */ \
      .Arg<ffi::AnyBuffer>()           /* x_alias */         \
      .Arg<ffi::AnyBuffer>()           /* ticket */          \
      .Ret<ffi::AnyBuffer>()           /* result */          \
      .Attrs<DoneAttrs>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclInstantiateCuda, InstantiateImpl, ffi::Ffi::BindInstantiate().Attrs<StartAttrs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclInitializeCuda, InitializeImpl,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::State<XSite>>()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .RemainingArgs()
                                  .RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclStartCuda, StartImpl, DFCCL_START_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclCollectiveCuda, CollectiveImpl, DFCCL_COLLECTIVE_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclDoneCuda, DoneImpl, DFCCL_DONE_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclStartHostCuda, StartHostImpl, DFCCL_START_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclCollectiveHostCuda, CollectiveHostImpl, DFCCL_COLLECTIVE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclDoneHostCuda, DoneHostImpl, DFCCL_DONE_BINDING);

void* XSiteTypeId() { return &XSite::id; }
void* XSiteTypeInfo() { return const_cast<XLA_FFI_TypeInfo*>(&kXSiteInfo); }

}  // namespace dfccl::gpu
