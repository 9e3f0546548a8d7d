// What XLA's FFI stages cost per call on the host, and whether a state made once
// per executable (the instantiate stage, FFI `State`) can take the attributes'
// decoding out of the stages XLA calls on every execution (the question of
// docs/design/execution_identity.md, "Cost").  Four targets, each a copy of its
// operand on the stream (command-buffer compatible), all taking the attributes of
// a jax_dfccl start (the same dictionary: a string, three arrays, five scalars):
//   cost_plain    execute only;
//   cost_stages   prepare (attributes decoded) + initialize (none bound) + execute;
//   cost_state    instantiate (attributes decoded once per executable, a state made)
//                 + prepare and initialize that take the state + execute;
//   cost_both     prepare and initialize both decoding the attributes + execute;
//   cost_init     initialize alone, decoding the attributes (no prepare) + execute;
//   cost_init_state  instantiate + initialize alone taking the state + execute.
// The prepare stages look the call site up in a map, as the runtime does, so the
// comparison holds the lookup's cost alike.  Built and run by costs.py.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Attrs {  // the shape of jax_dfccl's StartAttrs (xla_ffi/ffi/attrs.h)
  int32_t kind;
  int32_t reduce_op;
  std::string_view key;
  int64_t key_hash;
  int64_t site;
  int32_t group_size;
  ffi::Span<const int32_t> groups;
  ffi::Span<const int64_t> device_ids;
  ffi::Span<const int32_t> perm;
};

struct SiteState {  // what an instantiate stage keeps per call site
  static ffi::TypeId id;
  int64_t site = 0;
  int64_t key_hash = 0;
};
ffi::TypeId SiteState::id = {};
const XLA_FFI_TypeInfo kSiteStateInfo = ffi::MakeTypeInfo<SiteState>();

std::atomic<int64_t> calls[6][4];  // [target][stage]: 0 instantiate, 1 prepare, 2 initialize, 3 execute
std::mutex mu;
std::unordered_map<int64_t, int64_t>& sites = *new std::unordered_map<int64_t, int64_t>;

void Touch(int64_t site, int64_t key_hash) {  // the runtime's per-call lookup, roughly
  std::lock_guard lk(mu);
  sites[site] ^= key_hash;
}

ffi::Error Copy(cudaStream_t s, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const cudaError_t e = cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, s);
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error(ffi::ErrorCode::kInternal, "costs: copy");
}

template <int T>
ffi::Error Execute(cudaStream_t s, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, Attrs a) {
  calls[T][3]++;
  (void)a;
  return Copy(s, x, y);
}

template <int T>
ffi::Error PrepareAttrs(ffi::RunId, ffi::RemainingArgs, ffi::RemainingRets, Attrs a) {
  calls[T][1]++;
  Touch(a.site, a.key_hash);
  return ffi::Error::Success();
}

template <int T>
ffi::Error InitializeBare(cudaStream_t, ffi::RunId, ffi::RemainingArgs, ffi::RemainingRets) {
  calls[T][2]++;
  return ffi::Error::Success();
}

template <int T>
ffi::Error InitializeAttrs(cudaStream_t, ffi::RunId, ffi::RemainingArgs, ffi::RemainingRets, Attrs a) {
  calls[T][2]++;
  (void)a;
  return ffi::Error::Success();
}

template <int T>
ffi::Error InitializeTouch(cudaStream_t, ffi::RunId, ffi::RemainingArgs, ffi::RemainingRets, Attrs a) {
  calls[T][2]++;
  Touch(a.site, a.key_hash);
  return ffi::Error::Success();
}

template <int T>
ffi::ErrorOr<std::unique_ptr<SiteState>> Instantiate(Attrs a) {
  calls[T][0]++;
  auto st = std::make_unique<SiteState>();
  st->site = a.site;
  st->key_hash = a.key_hash;
  return ffi::ErrorOr<std::unique_ptr<SiteState>>(std::move(st));
}

ffi::Error PrepareState(SiteState* st, ffi::RunId, ffi::RemainingArgs, ffi::RemainingRets) {
  calls[2][1]++;
  Touch(st->site, st->key_hash);
  return ffi::Error::Success();
}

template <int T>
ffi::Error InitializeState(SiteState* st, cudaStream_t, ffi::RunId, ffi::RemainingArgs, ffi::RemainingRets) {
  calls[T][2]++;
  if (T == 5) Touch(st->site, st->key_hash);  // (the state target alone: the lookup here, as prepare's)
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(Attrs, ffi::StructMember<int32_t>("kind"), ffi::StructMember<int32_t>("reduce_op"),
                                      ffi::StructMember<std::string_view>("key"), ffi::StructMember<int64_t>("key_hash"),
                                      ffi::StructMember<int64_t>("site"), ffi::StructMember<int32_t>("group_size"),
                                      ffi::StructMember<ffi::Span<const int32_t>>("groups"),
                                      ffi::StructMember<ffi::Span<const int64_t>>("device_ids"),
                                      ffi::StructMember<ffi::Span<const int32_t>>("perm"));

#define COST_EXECUTE(T)                                                                                        \
  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attrs<Attrs>()
#define COST_PREPARE ffi::Ffi::BindPrepare().Ctx<ffi::RunId>().RemainingArgs().RemainingRets()
#define COST_INITIALIZE \
  ffi::Ffi::BindInitialize().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::RunId>().RemainingArgs().RemainingRets()
#define COST_INITIALIZE_STATE                                                                       \
  ffi::Ffi::BindInitialize().Ctx<ffi::State<SiteState>>().Ctx<ffi::PlatformStream<cudaStream_t>>() \
      .Ctx<ffi::RunId>().RemainingArgs().RemainingRets()

// plain: 0, stages: 1, state: 2, both: 3, init: 4, init_state: 5
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostPlainExecute, Execute<0>, COST_EXECUTE(0), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostStagesExecute, Execute<1>, COST_EXECUTE(1), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostStagesPrepare, PrepareAttrs<1>, COST_PREPARE.Attrs<Attrs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostStagesInitialize, InitializeBare<1>, COST_INITIALIZE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostStateExecute, Execute<2>, COST_EXECUTE(2), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostStateInstantiate, Instantiate<2>, ffi::Ffi::BindInstantiate().Attrs<Attrs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostStatePrepare, PrepareState,
                              ffi::Ffi::BindPrepare().Ctx<ffi::State<SiteState>>().Ctx<ffi::RunId>().RemainingArgs()
                                  .RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostStateInitialize, InitializeState<2>,
                              COST_INITIALIZE_STATE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostBothExecute, Execute<3>, COST_EXECUTE(3), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostBothPrepare, PrepareAttrs<3>, COST_PREPARE.Attrs<Attrs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostBothInitialize, InitializeAttrs<3>, COST_INITIALIZE.Attrs<Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(CostInitExecute, Execute<4>, COST_EXECUTE(4), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostInitInitialize, InitializeTouch<4>, COST_INITIALIZE.Attrs<Attrs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostInitStateExecute, Execute<5>, COST_EXECUTE(5), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostInitStateInstantiate, Instantiate<5>, ffi::Ffi::BindInstantiate().Attrs<Attrs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CostInitStateInitialize, InitializeState<5>,
                              COST_INITIALIZE_STATE);

// For costs.py (ctypes): the state type's id and info (jax.ffi.register_ffi_type), the call counts.
extern "C" void* cost_state_type_id() { return &SiteState::id; }
extern "C" void* cost_state_type_info() { return const_cast<XLA_FFI_TypeInfo*>(&kSiteStateInfo); }
extern "C" int64_t cost_calls(int target, int stage) { return calls[target][stage].load(); }
