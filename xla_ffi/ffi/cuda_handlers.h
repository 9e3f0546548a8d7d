// The CUDA FFI handler symbols (the target table lives in bindings/cuda_module.cc).
#pragma once

#include "xla/ffi/api/api.h"

namespace dfccl::gpu {
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclBookInstantiateCuda);  // dfccl_book: the program's execution book
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclBookInitializeCuda);   // ... its initialize stage (takes the state)
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclBookCuda);             // ... its execute stage
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclDoneCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclCollectiveCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclStartHostCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclDoneHostCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclCollectiveHostCuda);
// The state dfccl_book's stages share (ProgramBook): its FFI type id and info,
// registered with XLA before the targets (backend.py: jax.ffi.register_ffi_type).
void* ProgramBookTypeId();
void* ProgramBookTypeInfo();
}  // namespace dfccl::gpu
