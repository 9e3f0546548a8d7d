// Host entry points of the overlap kernels (no CUTLASS types).
#pragma once

#include <cuda_runtime.h>

#include "overlap/protocol.h"

namespace dfccl::overlap {

cudaError_t LaunchPush(const PushLaunch& a, cudaStream_t stream);
// AG copy-engine path: wait for the peer's ready (bounded), and, after the
// copy, raise the peer's chunk flags (one small block each, side stream).
cudaError_t LaunchReadyWait(const SideSync& s, cudaStream_t stream);
cudaError_t LaunchSignal(const SideSync& s, cudaStream_t stream);

// One instantiation per element type; ffi/overlap_handlers.cc holds the dispatch table.
cudaError_t LaunchGemmBF16(const GemmLaunch& l, cudaStream_t stream);
cudaError_t LaunchGemmF16(const GemmLaunch& l, cudaStream_t stream);

// Load every overlap kernel on the current device before any of them runs
// (lazy module loading would otherwise wait for the device to be idle at a
// kernel's first launch, while a wait kernel of ours spins: gemm_launch.cuh).
// Both cluster variants of each (GemmLaunch::cluster_m 1 and 2).
cudaError_t PreloadGemmBF16();
cudaError_t PreloadGemmF16();
// CTAs of the 2x1-cluster GEMM that fit on the current device at once (even;
// after the preload).
cudaError_t GemmClusterCtasBF16(int* ctas);
cudaError_t GemmClusterCtasF16(int* ctas);
cudaError_t PreloadSideKernels();  // push, ready wait, signal

}  // namespace dfccl::overlap
