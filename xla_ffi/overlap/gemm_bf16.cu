// One instantiation per element type (two TUs: they compile in parallel),
// every variant of each (cluster shapes, tile widths, bulk tensor stores: gemm_launch.cuh).
#include "overlap/gemm_launch.cuh"

namespace dfccl::overlap {
cudaError_t LaunchGemmBF16(const GemmLaunch& l, cudaStream_t s) { return LaunchGemm<cutlass::bfloat16_t>(l, s); }
cudaError_t PreloadGemmBF16() { return PreloadGemm<cutlass::bfloat16_t>(); }
cudaError_t GemmClusterCtasBF16(int* ctas) { return GemmClusterCtas<cutlass::bfloat16_t>(ctas); }
}  // namespace dfccl::overlap
