// The FFI boundary of the CPU backend: decode, call the runtime, convert every
// exception to an ffi::Error.  The handlers carry no traits: they do host work
// and must never be captured into a command buffer.
#include <exception>
#include <optional>

#include "cpu/handlers.h"
#include "cpu/runtime.h"
#include "ffi/attrs.h"
#include "ffi/error.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// dfccl_start(x, partition_id[, init]) -> (out, x_alias, ticket).  Never blocks.
ffi::Error StartImpl(ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer partition_id, std::optional<ffi::AnyBuffer> init,
                     ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> x_alias, ffi::Result<ffi::AnyBuffer> ticket,
                     dfccl::StartAttrs attrs) {
  return dfccl::FfiGuard([&] {
    DFCCL_CHECK(partition_id.element_type() == ffi::DataType::S32 && partition_id.element_count() == 1,
                "dfccl: collective '" << attrs.key << "': partition_id must be s32[]");
    DFCCL_CHECK(ticket->element_type() == ffi::DataType::S64 && ticket->element_count() == 1,
                "dfccl: collective '" << attrs.key << "': ticket must be s64[]");
    const int32_t pid = *static_cast<const int32_t*>(partition_id.untyped_data());
    dfccl::CollectiveSpec spec = dfccl::ParseSpec(attrs, pid, x.element_type(), static_cast<int64_t>(x.element_count()),
                                                  static_cast<int64_t>(out->element_count()));
    DFCCL_CHECK(out->element_type() == x.element_type(),
                "dfccl: collective '" << attrs.key << "': result and input element types differ");
    // An op whose output starts from the caller's values (ragged_all_to_all)
    // passes them as `init`; the runtime copies them into its own output.
    const void* init_values = nullptr;
    if (init.has_value()) {
      DFCCL_CHECK(init->size_bytes() == out->size_bytes(),
                  "dfccl: collective '" << attrs.key << "': init does not match the result");
      init_values = init->untyped_data();
    }
    // The runtime copies x before this returns and writes the output into
    // done's result (or its own memory, copied by done), so nothing of this
    // execution is touched after a failure XLA abandons it for (cpu::Task).
    // x_alias and out are part of the contract shared with the CUDA handlers,
    // which read and write XLA's buffers in place; here they only order the calls.
    const int64_t t = dfccl::cpu::StartCollective(spec, x.untyped_data(), init_values, run_id.run_id);
    *static_cast<int64_t*>(ticket->untyped_data()) = t;
  });
}

// dfccl_done(out, x_alias, ticket) -> result: the instance's output, computed
// into result (or copied there after the wait).  Asynchronous: returns a
// future that completes when every rank finished the instance (or it failed),
// so XLA's device thread is never blocked and can still run this device's
// other starts (a blocked thread could close a cycle with a peer device whose
// executor ordered independent collectives the other way round).
ffi::Future DoneImpl(ffi::AnyBuffer out, ffi::AnyBuffer x_alias, ffi::AnyBuffer ticket,
                     ffi::Result<ffi::AnyBuffer> result, dfccl::DoneAttrs attrs) {
  (void)out;
  (void)x_alias;
  ffi::Promise promise;
  ffi::Future future(promise);
  ffi::Error error = dfccl::FfiGuard([&] {
    DFCCL_CHECK(ticket.element_type() == ffi::DataType::S64 && ticket.element_count() == 1,
                "dfccl: collective '" << attrs.key << "': ticket must be s64[]");
    const int64_t t = *static_cast<const int64_t*>(ticket.untyped_data());
    dfccl::cpu::WaitCollectiveAsync(t, attrs.key, result->untyped_data(), static_cast<int64_t>(result->size_bytes()),
                                    [promise](const dfccl::cpu::DoneStatus& st) mutable {
                                      if (!st.ok()) return promise.SetError(dfccl::FfiStatus(st));
                                      promise.SetAvailable();
                                    });
  });
  if (!error.success()) promise.SetError(std::move(error));
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclCpuStart, StartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()       // the execution (see cpu::Tombstone)
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // partition_id
                                  .OptionalArg<ffi::AnyBuffer>()  // init (aliased to out)
                                  .Ret<ffi::AnyBuffer>()   // out
                                  .Ret<ffi::AnyBuffer>()   // x_alias
                                  .Ret<ffi::AnyBuffer>()   // ticket
                                  .Attrs<dfccl::StartAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DfcclCpuDone, DoneImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // out
                                  .Arg<ffi::AnyBuffer>()   // x_alias
                                  .Arg<ffi::AnyBuffer>()   // ticket
                                  .Ret<ffi::AnyBuffer>()   // result (aliased to out in the blocking form)
                                  .Attrs<dfccl::DoneAttrs>());
