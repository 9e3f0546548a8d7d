// One instantiation per element type (two TUs: they compile in parallel),
// both cluster variants of each.
#include "overlap/gemm.cuh"

namespace dfccl::overlap {
cudaError_t LaunchGemmBF16(const GemmLaunch& l, cudaStream_t s) { return LaunchGemm<cutlass::bfloat16_t>(l, s); }
cudaError_t PreloadGemmBF16() { return PreloadGemm<cutlass::bfloat16_t>(); }
cudaError_t GemmClusterCtasBF16(int* ctas) { return GemmClusterCtas<cutlass::bfloat16_t>(ctas); }
}  // namespace dfccl::overlap
