// Stock CUTLASS sm90 GEMMs (GemmUniversal, persistent tile scheduler, TMA
// epilogue) for bfloat16 row-major A (m x k) and B (k x n), f32 accumulation,
// in a few tile / cluster / schedule shapes: the reference the fused overlap
// GEMM (xla_ffi/overlap/gemm.cuh, benchmarks/overlap_gemm.py) is held against.
//
//   nvcc -std=c++17 -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I<cutlass>/include \
//        -I<cutlass>/tools/util/include -o cutlass_gemm_probe tools/cutlass_gemm_probe.cu
// (without -DNDEBUG the asserts make ptxas serialize the wgmma pipeline: warning C7510)
//   ./cutlass_gemm_probe [--steady] 1024x4096x7168 4096x4096x7168 ...
// Operands are random (A ~ U(-1, 1), B ~ U(-1, 1) / sqrt(k): the tensor cores'
// power, and so the clocks under the power limit, depend on the data).
// Prints, per shape and configuration, the median kernel time over 20 runs (CUDA
// events), or with --steady the steady state as benchmarks/overlap_gemm.py times
// it: per rep every configuration in turn (rep r starts with the r-th), each
// timed block of back-to-back launches (>= 30 ms) after an untimed block of the
// same configuration; median over 5 reps.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
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

static bool g_steady = false;

// One configuration's GEMM, initialized for (m, n, k): run() launches it once.
struct Probe {
  const char* name;
  void (*run)(void*);
  void* gemm;
};

template <class Cfg>
float Run(const char* name, int m, int n, int k, T* a, T* b, T* d, std::vector<Probe>* keep) {
  using Gemm = typename Cfg::Gemm;
  using K = typename Gemm::GemmKernel;
  auto sa = cutlass::make_cute_packed_stride(typename K::StrideA{}, {m, k, 1});
  auto sb = cutlass::make_cute_packed_stride(typename K::StrideB{}, {n, k, 1});
  auto sc = cutlass::make_cute_packed_stride(typename K::StrideC{}, {m, n, 1});
  auto sd = cutlass::make_cute_packed_stride(typename K::StrideD{}, {m, n, 1});
  auto hw = cutlass::KernelHardwareInfo::make_kernel_hardware_info<K>(0);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {m, n, k, 1}, {a, sa, b, sb},
                                {{1.0f, 0.0f}, d, sc, d, sd}, hw};
  auto gp = std::make_unique<Gemm>();
  Gemm& gemm = *gp;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    std::printf("  %-34s cannot implement\n", name);
    return 0;
  }
  void* ws = nullptr;
  const size_t wsz = Gemm::get_workspace_size(args);
  if (wsz) CHECK_CUDA(cudaMalloc(&ws, wsz));
  if (gemm.initialize(args, ws) != cutlass::Status::kSuccess) std::exit(2);
  if (g_steady) {  // timed later, in turns (ws and the Gemm live until the process ends)
    keep->push_back({name, [](void* g) { static_cast<Gemm*>(g)->run(); }, gp.release()});
    return 0;
  }
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

// Steady state of each probe (see the header), median us per GEMM.
void Steady(std::vector<Probe>& ps, int m, int n, int k) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<int> calls(ps.size());
  std::vector<std::vector<float>> ts(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i].run(ps[i].gemm);
    CHECK_CUDA(cudaEventRecord(e0));
    ps[i].run(ps[i].gemm);
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    calls[i] = std::max(1, std::min(4096, int(30.0f / std::max(ms, 1e-3f)) + 1));
  }
  for (size_t r = 0; r < 5; ++r)
    for (size_t j = 0; j < ps.size(); ++j) {
      const size_t i = (j + r) % ps.size();
      for (int c = 0; c < calls[i]; ++c) ps[i].run(ps[i].gemm);  // untimed: this probe's own power state
      CHECK_CUDA(cudaEventRecord(e0));
      for (int c = 0; c < calls[i]; ++c) ps[i].run(ps[i].gemm);
      CHECK_CUDA(cudaEventRecord(e1));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      ts[i].push_back(ms * 1e3f / calls[i]);
    }
  CHECK_CUDA(cudaGetLastError());
  for (size_t i = 0; i < ps.size(); ++i) {
    std::sort(ts[i].begin(), ts[i].end());
    const float us = ts[i][ts[i].size() / 2];
    std::printf("  %-34s %8.1f us %6.0f TFLOP/s (steady)\n", ps[i].name, us, 2.0 * m * n * k / (us * 1e-6) / 1e12);
  }
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
}

// Uniform random bf16 in [-scale, scale) (a fixed-seed LCG).
void FillRandom(T* dev, size_t count, float scale, uint32_t seed) {
  std::vector<T> h(count);
  uint32_t x = seed;
  for (size_t i = 0; i < count; ++i) {
    x = x * 1664525u + 1013904223u;
    h[i] = T(scale * (float(x >> 8) * (2.0f / 16777216.0f) - 1.0f));
  }
  CHECK_CUDA(cudaMemcpy(dev, h.data(), count * sizeof(T), cudaMemcpyHostToDevice));
}

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpiCoop = cutlass::epilogue::TmaWarpSpecializedCooperative;
using EpiPing = cutlass::epilogue::TmaWarpSpecialized;

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--steady") {
      g_steady = true;
      continue;
    }
    int m, n, k;
    if (std::sscanf(argv[i], "%dx%dx%d", &m, &n, &k) != 3) return 1;
    T *a, *b, *d;
    CHECK_CUDA(cudaMalloc(&a, size_t(m) * k * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&b, size_t(k) * n * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&d, size_t(m) * n * sizeof(T)));
    FillRandom(a, size_t(m) * k, 1.0f, 1u);
    FillRandom(b, size_t(k) * n, 1.0f / std::sqrt(float(k)), 2u);
    std::printf("%dx%dx%d\n", m, n, k);
    std::vector<Probe> ps;
    Run<Config<Shape<_128, _256, _64>, Shape<_1, _1, _1>, Coop, EpiCoop>>("coop 128x256x64 cluster 1x1", m, n, k, a, b, d, &ps);
    Run<Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, EpiCoop>>("coop 128x256x64 cluster 2x1", m, n, k, a, b, d, &ps);
    Run<Config<Shape<_128, _128, _64>, Shape<_1, _1, _1>, Coop, EpiCoop>>("coop 128x128x64 cluster 1x1", m, n, k, a, b, d, &ps);
    Run<Config<Shape<_256, _128, _64>, Shape<_1, _2, _1>, Coop, EpiCoop>>("coop 256x128x64 cluster 1x2", m, n, k, a, b, d, &ps);
    Run<Config<Shape<_128, _128, _64>, Shape<_1, _1, _1>, Ping, EpiPing>>("pingpong 128x128x64 cluster 1x1", m, n, k, a, b, d, &ps);
    Run<Config<Shape<_128, _128, _64>, Shape<_2, _1, _1>, Ping, EpiPing>>("pingpong 128x128x64 cluster 2x1", m, n, k, a, b, d, &ps);
    Run<Config<Shape<_128, _192, _64>, Shape<_1, _1, _1>, Ping, EpiPing>>("pingpong 128x192x64 cluster 1x1", m, n, k, a, b, d, &ps);
    if (g_steady) Steady(ps, m, n, k);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaFree(a));
    CHECK_CUDA(cudaFree(b));
    CHECK_CUDA(cudaFree(d));
  }
  return 0;
}
