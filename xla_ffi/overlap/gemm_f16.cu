// One instantiation per element type (two TUs: they compile in parallel),
// both cluster variants of each.
#include "overlap/gemm.cuh"

namespace dfccl::overlap {
cudaError_t LaunchGemmF16(const GemmLaunch& l, cudaStream_t s) { return LaunchGemm<cutlass::half_t>(l, s); }
cudaError_t PreloadGemmF16() { return PreloadGemm<cutlass::half_t>(); }
cudaError_t GemmClusterCtasF16(int* ctas) { return GemmClusterCtas<cutlass::half_t>(ctas); }
}  // namespace dfccl::overlap
