// The CPU FFI handlers (defined in xla_ffi/ffi/cpu_handlers.cc), exported to
// Python by xla_ffi/bindings/cpu_module.cc as capsules.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* DfcclCpuStart(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* DfcclCpuDone(XLA_FFI_CallFrame* call_frame);
