// The CUDA FFI handler symbols (the target table lives in bindings/cuda_module.cc).
#pragma once

#include "xla/ffi/api/api.h"

namespace dfccl::gpu {
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclInstantiateCuda);  // the instantiate stage of dfccl_{start,collective}_x
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclInitializeCuda);   // ... and their initialize stage (takes its state)
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclDoneCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclCollectiveCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclStartHostCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclDoneHostCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclCollectiveHostCuda);
// The state those two stages share (XSite): its FFI type id and info, registered
// with XLA before the targets (backend.py: jax.ffi.register_ffi_type).
void* XSiteTypeId();
void* XSiteTypeInfo();
}  // namespace dfccl::gpu
