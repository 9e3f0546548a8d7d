// Host entry points into the daemon kernel (implemented in daemon_kernel.cu).
#pragma once

#include <cuda_runtime.h>

#include "dfccl/collective.h"
#include "device/task.h"

namespace dfccl::gpu {

// Launches one daemon (params.workers worker blocks + 1 control block) on `stream`.
cudaError_t LaunchDaemon(const DaemonParams& params, cudaStream_t stream);

// Enqueues on `stream` a one-thread kernel that returns once (int32_t)(*addr - value) >= 0;
// with `rec`, it stores `proto` stamped kEvStreamWait at its start into rec[0]
// and stamped kEvStreamWoke at its end into rec[1].
cudaError_t LaunchStreamWait(cudaStream_t stream, const uint32_t* addr, uint32_t value, TraceRec* rec,
                             const TraceRec& proto);

}  // namespace dfccl::gpu
