// The CUDA FFI handler symbols (the target table lives in bindings/cuda_module.cc).
#pragma once

#include "xla/ffi/api/api.h"

namespace dfccl::gpu {
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclPrepareCuda);  // the prepare stage of dfccl_start and dfccl_collective
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclInitializeCuda);  // ... and their initialize stage
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclDoneCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclCollectiveCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclStartHostCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclDoneHostCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DfcclCollectiveHostCuda);
}  // namespace dfccl::gpu
