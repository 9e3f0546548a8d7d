// Host entry points into the daemon kernel (implemented in daemon_kernel.cu).
#pragma once

#include <cuda_runtime.h>

#include "dfccl/collective.h"
#include "device/task.h"

namespace dfccl::gpu {

// Launches one daemon (params.workers worker blocks + 1 control block) on `stream`.
cudaError_t LaunchDaemon(const DaemonParams& params, cudaStream_t stream);

}  // namespace dfccl::gpu
