// One instantiation per element type (two TUs: they compile in parallel),
// every variant of each (cluster shapes, tile widths, bulk tensor stores: gemm_launch.cuh).
#include "overlap/gemm_launch.cuh"

namespace dfccl::overlap {
cudaError_t LaunchGemmF16(const GemmLaunch& l, cudaStream_t s) { return LaunchGemm<cutlass::half_t>(l, s); }
cudaError_t PreloadGemmF16() { return PreloadGemm<cutlass::half_t>(); }
cudaError_t GemmClusterCtasF16(int* ctas) { return GemmClusterCtas<cutlass::half_t>(ctas); }
}  // namespace dfccl::overlap
