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
#include <deque>
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

// The program's execution book (protocol "run" in device/task.h): one dfccl_book
// call per program whose collectives have groups spanning processes (core.py lowers
// it with the program's first such start, which takes its result as its partition
// id operand, and lists every such start in its attributes).  XLA's instantiate
// stage decodes the list once per executable into this state; per GPU each start's
// key book is found at the program's first execution there.  XLA shares one state
// between the devices that run the thunk (they may call concurrently).
struct ProgramBook {
  static ffi::TypeId id;
  struct Start {
    int64_t key_hash, site;
    int32_t table;
  };
  struct Table {  // a start's group table, as dfccl_start's attributes give it
    int32_t group_size = 0;
    std::vector<int32_t> groups;
    std::vector<int64_t> device_ids;
  };
  std::vector<Start> starts;
  std::vector<Table> tables;
  static constexpr int kMaxOrdinals = DaemonPath::kMaxOrdinals;

  // Per start, its key's book on this GPU (null: a group inside this process).
  const std::vector<KeyRuns*>& BooksOf(int32_t ordinal) {
    DFCCL_CHECK(ordinal >= 0 && ordinal < kMaxOrdinals, "dfccl: GPU ordinal " << ordinal << " out of range");
    if (const auto* b = books_[ordinal].load(std::memory_order_acquire)) return *b;
    std::lock_guard lk(mu_);
    if (const auto* b = books_[ordinal].load(std::memory_order_relaxed)) return *b;
    std::vector<KeyRuns*>& out = found_.emplace_back();
    for (const Start& st : starts) {
      const Table& t = tables[st.table];
      const StartAttrs a{0, 0, "(the program's book)", st.key_hash, st.site, t.group_size,
                         ffi::Span<const int32_t>(t.groups), ffi::Span<const int64_t>(t.device_ids),
                         ffi::Span<const int32_t>()};
      const int32_t pid = PartitionOf(a, ordinal);
      int32_t rank = 0;
      out.push_back(pid < 0 ? nullptr
                            : Runtime::Get().daemon().BookOf(ordinal, GroupOf(a, pid, &rank),
                                                             static_cast<uint64_t>(st.key_hash)));
    }
    books_[ordinal].store(&out, std::memory_order_release);
    return out;
  }

 private:
  std::mutex mu_;
  std::deque<std::vector<KeyRuns*>> found_;  // (stable addresses)
  std::array<std::atomic<const std::vector<KeyRuns*>*>, kMaxOrdinals> books_{};
};
ffi::TypeId ProgramBook::id = {};
const XLA_FFI_TypeInfo kProgramBookInfo = ffi::MakeTypeInfo<ProgramBook>();

// Attributes (core.py): per start key_hashes, sites, tables (its group table's
// index); per group table group_sizes, groups and device_ids concatenated, with
// groups_at and device_ids_at the offsets (one more than tables).
ffi::ErrorOr<std::unique_ptr<ProgramBook>> BookInstantiateImpl(
    ffi::Span<const int64_t> key_hashes, ffi::Span<const int64_t> sites, ffi::Span<const int32_t> table_of,
    ffi::Span<const int32_t> group_sizes, ffi::Span<const int32_t> groups, ffi::Span<const int64_t> groups_at,
    ffi::Span<const int64_t> device_ids, ffi::Span<const int64_t> device_ids_at) {
  auto b = std::make_unique<ProgramBook>();
  const size_t n = key_hashes.size(), t = group_sizes.size();
  auto bad = [] { return ffi::ErrorOr<std::unique_ptr<ProgramBook>>(ffi::Error::InvalidArgument(
                      "dfccl: malformed program book (dfccl_book attributes)")); };
  if (sites.size() != n || table_of.size() != n || groups_at.size() != t + 1 || device_ids_at.size() != t + 1)
    return bad();
  for (size_t i = 0; i < t; ++i) {
    const int64_t g0 = groups_at[i], g1 = groups_at[i + 1], d0 = device_ids_at[i], d1 = device_ids_at[i + 1];
    if (g0 < 0 || g1 < g0 || g1 > static_cast<int64_t>(groups.size()) || d0 < 0 || d1 < d0 ||
        d1 > static_cast<int64_t>(device_ids.size()))
      return bad();
    b->tables.push_back(ProgramBook::Table{group_sizes[i], std::vector<int32_t>(groups.begin() + g0, groups.begin() + g1),
                                           std::vector<int64_t>(device_ids.begin() + d0, device_ids.begin() + d1)});
  }
  for (size_t i = 0; i < n; ++i) {
    if (table_of[i] < 0 || static_cast<size_t>(table_of[i]) >= t) return bad();
    b->starts.push_back(ProgramBook::Start{key_hashes[i], sites[i], table_of[i]});
  }
  return ffi::ErrorOr<std::unique_ptr<ProgramBook>>(std::move(b));
}

// Its initialize stage: XLA calls it once per execution, before any of the
// program's thunks runs (failed executions too; for thunks inside command buffers
// too), with the execution's stream (not capturing)
// (measured: benchmarks/results/ffi_stages_2026-12-06_h100.json).  It opens or
// keeps each start's line of its key's book (protocol "run" in device/task.h) and,
// the execution's first on this GPU, writes its launch id on the stream for the
// starts XLA replays from command buffers.  One call per execution and program:
// XLA's stage call costs 1-3 us on the host (tools/ffi_stage_probe/costs.py), so
// the starts themselves have no stage.
ffi::Error BookInitializeImpl(ProgramBook* b, cudaStream_t stream, int32_t ordinal, ffi::RunId run) {
  return FfiGuard([&] {
    const uint32_t r = RunOf(run);
    if (r == 0) return;  // XLA without collective parameters: no launch id
    const std::vector<KeyRuns*>& books = b->BooksOf(ordinal);
    for (size_t i = 0; i < books.size(); ++i)
      if (books[i] != nullptr) Runtime::Get().daemon().Plan(ordinal, *books[i], r, b->starts[i].site);
    Runtime::Get().daemon().BeginExecution(ordinal, stream, r);
  });
}

// Its execute stage: the partition id operand of the program's first such start
// (0: the CUDA handlers find their partition from the device), so XLA keeps the
// call and orders it before that start.  A memset: capturable into command buffers.
ffi::Error BookImpl(cudaStream_t stream, ffi::Result<ffi::AnyBuffer> pid) {
  return FfiGuard([&] {
    DFCCL_CHECK_CUDA(cudaMemsetAsync(pid->untyped_data(), 0, pid->size_bytes(), stream), "dfccl: the program's book");
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclBookInstantiateCuda, BookInstantiateImpl,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<ffi::Span<const int64_t>>("key_hashes")
                                  .Attr<ffi::Span<const int64_t>>("sites")
                                  .Attr<ffi::Span<const int32_t>>("tables")
                                  .Attr<ffi::Span<const int32_t>>("group_sizes")
                                  .Attr<ffi::Span<const int32_t>>("groups")
                                  .Attr<ffi::Span<const int64_t>>("groups_at")
                                  .Attr<ffi::Span<const int64_t>>("device_ids")
                                  .Attr<ffi::Span<const int64_t>>("device_ids_at"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclBookInitializeCuda, BookInitializeImpl,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::State<ProgramBook>>()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclBookCuda, BookImpl,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclStartCuda, StartImpl, DFCCL_START_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclCollectiveCuda, CollectiveImpl, DFCCL_COLLECTIVE_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclDoneCuda, DoneImpl, DFCCL_DONE_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclStartHostCuda, StartHostImpl, DFCCL_START_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclCollectiveHostCuda, CollectiveHostImpl, DFCCL_COLLECTIVE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclDoneHostCuda, DoneHostImpl, DFCCL_DONE_BINDING);

void* ProgramBookTypeId() { return &ProgramBook::id; }
void* ProgramBookTypeInfo() { return const_cast<XLA_FFI_TypeInfo*>(&kProgramBookInfo); }

}  // namespace dfccl::gpu
