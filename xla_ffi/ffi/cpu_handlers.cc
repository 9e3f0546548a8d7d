// The FFI boundary of the CPU backend: decode, call the runtime, convert every
// exception to an ffi::Error.  The handlers carry no traits: they do host work
// and must never be captured into a command buffer.
#include <cstring>
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
    // passes them as `init`, aliased to out; XLA may still hand over a copy.
    if (init.has_value()) {
      DFCCL_CHECK(init->size_bytes() == out->size_bytes(),
                  "dfccl: collective '" << attrs.key << "': init does not match the result");
      if (init->untyped_data() != out->untyped_data() && init->size_bytes() > 0)
        std::memcpy(out->untyped_data(), init->untyped_data(), init->size_bytes());
    }
    DFCCL_CHECK(x_alias->size_bytes() == x.size_bytes(),
                "dfccl: collective '" << attrs.key << "': x_alias does not match x");
    // Peers read the input until done(); x_alias is what keeps it alive.  When
    // XLA did not alias it to x, post x_alias (a copy) rather than x.
    const void* in = x.untyped_data();
    if (x_alias->untyped_data() != in && x.size_bytes() > 0) {
      std::memcpy(x_alias->untyped_data(), in, x.size_bytes());
      in = x_alias->untyped_data();
    }
    const int64_t t = dfccl::cpu::StartCollective(spec, in, out->untyped_data(), run_id.run_id);
    *static_cast<int64_t*>(ticket->untyped_data()) = t;
  });
}

// dfccl_done(out, x_alias, ticket) -> result (out itself when XLA aliased them,
// as in the blocking form; else a copy taken after the wait).  Asynchronous: returns a
// future that completes when every rank finished the instance (or it failed),
// so XLA's device thread is never blocked and can still run this device's
// other starts (a blocked thread could close a cycle with a peer device whose
// executor ordered independent collectives the other way round).
ffi::Future DoneImpl(ffi::AnyBuffer out, ffi::AnyBuffer x_alias, ffi::AnyBuffer ticket,
                     ffi::Result<ffi::AnyBuffer> result, dfccl::DoneAttrs attrs) {
  (void)x_alias;
  ffi::Promise promise;
  ffi::Future future(promise);
  ffi::Error error = dfccl::FfiGuard([&] {
    DFCCL_CHECK(ticket.element_type() == ffi::DataType::S64 && ticket.element_count() == 1,
                "dfccl: collective '" << attrs.key << "': ticket must be s64[]");
    DFCCL_CHECK(result->size_bytes() == out.size_bytes(), "dfccl: done result does not match out");
    const int64_t t = *static_cast<const int64_t*>(ticket.untyped_data());
    void* dst = result->untyped_data();
    const void* src = out.untyped_data();
    const size_t bytes = out.size_bytes();
    dfccl::cpu::WaitCollectiveAsync(t, attrs.key, [promise, dst, src, bytes](const dfccl::cpu::DoneStatus& st) mutable {
      if (!st.ok()) return promise.SetError(dfccl::FfiStatus(st));
      if (dst != src && bytes > 0) std::memcpy(dst, src, bytes);
      promise.SetAvailable();
    }, bytes > 0 ? src : nullptr);
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
