// Stock CUTLASS sm90 GEMMs (GemmUniversal, persistent tile scheduler, TMA
// epilogue) for bfloat16 row-major A (m x k) and B (k x n), f32 accumulation,
// in a few tile / cluster / schedule shapes: the reference the fused overlap
// GEMM (xla_ffi/overlap/gemm.cuh, benchmarks/overlap_gemm.py) is held against.
//
//   nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -I<cutlass>/include \
//        -I<cutlass>/tools/util/include -o cutlass_gemm_probe tools/cutlass_gemm_probe.cu
// (without -DNDEBUG the asserts make ptxas serialize the wgmma pipeline: warning C7510)
//   ./cutlass_gemm_probe 1024x4096x7168 4096x4096x7168 ...
// Prints, per shape and configuration, the median kernel time over 20 runs (CUDA events).
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace cute;
using T = cutlass::bfloat16_t;

#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

template <class Tile, class Cluster, class KernelSched, class EpiSched>
struct Config {
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, T, cutlass::layout::RowMajor, 8, T, cutlass::layout::RowMajor, 8, EpiSched>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T, cutlass::layout::RowMajor,
      8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      KernelSched>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Cfg>
float Run(const char* name, int m, int n, int k, T* a, T* b, T* d) {
  using Gemm = typename Cfg::Gemm;
  using K = typename Gemm::GemmKernel;
  auto sa = cutlass::make_cute_packed_stride(typename K::StrideA{}, {m, k, 1});
  auto sb = cutlass::make_cute_packed_stride(typename K::StrideB{}, {n, k, 1});
  auto sc = cutlass::make_cute_packed_stride(typename K::StrideC{}, {m, n, 1});
  auto sd = cutlass::make_cute_packed_stride(typename K::StrideD{}, {m, n, 1});
  auto hw = cutlass::KernelHardwareInfo::make_kernel_hardware_info<K>(0);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {m, n, k, 1}, {a, sa, b, sb},
                                {{1.0f, 0.0f}, d, sc, d, sd}, hw};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    std::printf("  %-34s cannot implement\n", name);
    return 0;
  }
  void* ws = nullptr;
  const size_t wsz = Gemm::get_workspace_size(args);
  if (wsz) CHECK_CUDA(cudaMalloc(&ws, wsz));
  if (gemm.initialize(args, ws) != cutlass::Status::kSuccess) std::exit(2);
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) gemm.run();
  std::vector<float> ts;
  for (int i = 0; i < 20; ++i) {
    CHECK_CUDA(cudaEventRecord(e0));
    gemm.run();
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    ts.push_back(ms);
  }
  CHECK_CUDA(cudaGetLastError());
  std::sort(ts.begin(), ts.end());
  const float us = ts[ts.size() / 2] * 1e3f;
  std::printf("  %-34s %8.1f us %6.0f TFLOP/s\n", name, us, 2.0 * m * n * k / (us * 1e-6) / 1e12);
  if (ws) CHECK_CUDA(cudaFree(ws));
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  return us;
}

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpiCoop = cutlass::epilogue::TmaWarpSpecializedCooperative;
using EpiPing = cutlass::epilogue::TmaWarpSpecialized;

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    int m, n, k;
    if (std::sscanf(argv[i], "%dx%dx%d", &m, &n, &k) != 3) return 1;
    T *a, *b, *d;
    CHECK_CUDA(cudaMalloc(&a, size_t(m) * k * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&b, size_t(k) * n * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&d, size_t(m) * n * sizeof(T)));
    CHECK_CUDA(cudaMemset(a, 0x3c, size_t(m) * k * sizeof(T)));  // ~1.1 (bf16 0x3c3c)
    CHECK_CUDA(cudaMemset(b, 0x3c, size_t(k) * n * sizeof(T)));
    std::printf("%dx%dx%d\n", m, n, k);
    Run<Config<Shape<_128, _256, _64>, Shape<_1, _1, _1>, Coop, EpiCoop>>("coop 128x256x64 cluster 1x1", m, n, k, a, b, d);
    Run<Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, EpiCoop>>("coop 128x256x64 cluster 2x1", m, n, k, a, b, d);
    Run<Config<Shape<_256, _128, _64>, Shape<_1, _2, _1>, Coop, EpiCoop>>("coop 256x128x64 cluster 1x2", m, n, k, a, b, d);
    Run<Config<Shape<_128, _128, _64>, Shape<_2, _1, _1>, Ping, EpiPing>>("pingpong 128x128x64 cluster 2x1", m, n, k, a, b, d);
    CHECK_CUDA(cudaFree(a));
    CHECK_CUDA(cudaFree(b));
    CHECK_CUDA(cudaFree(d));
  }
  return 0;
}
