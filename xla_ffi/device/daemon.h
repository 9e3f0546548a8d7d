// Host entry points into the daemon kernel (implemented in daemon_kernel.cu).
#pragma once

#include <cuda_runtime.h>

#include "dfccl/collective.h"
#include "device/task.h"

namespace dfccl::gpu {

// Launches one daemon (params.workers worker blocks + 1 control block) on `stream`.
cudaError_t LaunchDaemon(const DaemonParams& params, cudaStream_t stream);

// The device address of the templated step for (kind, dtype, reduce) on the
// current device.  Dispatches the dtype through dfccl::DispatchDType; runs a
// one-thread kernel on `stream` and synchronizes it (device init only).
const void* StepAddress(OpKind kind, DType dtype, ReduceOp reduce, cudaStream_t stream);

}  // namespace dfccl::gpu
