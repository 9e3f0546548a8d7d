// Host side of the fused overlap GEMM (gemm.cuh): loading the kernel variants,
// the one dispatch over them (cluster shape, tile width, bulk tensor stores),
// launch configurations, the TMA descriptors (operands' and, for the TMA
// variants, the output's) and the launch.  Included once per element type
// (gemm_bf16.cu, gemm_f16.cu).
#pragma once

#include <cutlass/cuda_host_adapter.hpp>

#include <algorithm>
#include <iterator>
#include <mutex>
#include <type_traits>
#include <utility>

#include "overlap/gemm.cuh"

namespace dfccl::overlap {

// Loads the kernel variants on the current device and sets their shared-memory
// size.  Called when a device is first used (ffi/overlap_handlers.cc): with lazy module
// loading the first launch of a kernel loads it, which waits for the whole
// device to be idle -- including a side stream's wait kernel that spins until
// this very GEMM has made progress (RS copy engine): a deadlock until the wait
// times out.
template <class T, int CM, int TN, bool TMA, bool PP>
cudaError_t PreloadVariant() {
  cudaFuncAttributes a;
  const cudaError_t e =
      cudaFuncSetAttribute(OverlapGemmKernel<T, CM, TN, TMA, PP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(sizeof(typename GemmCfg<T, CM, TN, TMA, PP>::SharedStorage)));
  return e != cudaSuccess ? e : cudaFuncGetAttributes(&a, OverlapGemmKernel<T, CM, TN, TMA, PP>);
}

// The one dispatch over the variants: f<CM, TN, TMA, PP>() for a launch's
// cluster shape, tile width (one of kTileNs: instantiated from that table),
// bulk tensor stores (1x1 clusters only) and schedule (ping-pong: 1x1
// clusters, 128 columns), or cudaErrorInvalidValue for others.
template <int CM, bool TMA, class F, size_t... I>
cudaError_t ForWidth(int tile_n, F& f, std::index_sequence<I...>) {
  cudaError_t e = cudaErrorInvalidValue;
  (void)((tile_n == kTileNs[I] && ((e = f.template operator()<CM, kTileNs[I], TMA, false>()), true)) || ...);
  return e;
}
template <class F>
cudaError_t ForVariant(int cluster_m, int tile_n, bool tma, bool pingpong, F&& f) {
  constexpr auto widths = std::make_index_sequence<std::size(kTileNs)>{};
  if (pingpong) {
    if (cluster_m != 1 || tile_n != 128) return cudaErrorInvalidValue;
    return tma ? f.template operator()<1, 128, true, true>() : f.template operator()<1, 128, false, true>();
  }
  if (cluster_m == 1) return tma ? ForWidth<1, true>(tile_n, f, widths) : ForWidth<1, false>(tile_n, f, widths);
  if (cluster_m == 2 && !tma) return ForWidth<2, false>(tile_n, f, widths);
  return cudaErrorInvalidValue;
}

template <class T>
cudaError_t PreloadGemm() {
  for (int cm : {1, 2})
    for (bool tma : {false, true})
      for (bool pp : {false, true})
        for (int tn : kTileNs) {
          if ((tma && cm != 1) || (pp && (cm != 1 || tn != 128))) continue;
          const cudaError_t e = ForVariant(cm, tn, tma, pp, [&]<int CM, int TN, bool TMA, bool PP>() {
            return PreloadVariant<T, CM, TN, TMA, PP>();
          });
          if (e != cudaSuccess) return e;
        }
  return cudaSuccess;
}

// Launch configuration of variant CM with `grid` CTAs on `stream`: dynamic
// shared memory and, for CM > 1, the cluster shape (`attr` must outlive it).
// With `pdl`, programmatic stream serialization: the kernel may launch while the
// stream's previous kernel still runs (it waits for it in GridDependencyWait).
// `attr` holds two entries and must outlive the launch.
template <class T, int CM, int TN, bool TMA, bool PP>
cudaLaunchConfig_t LaunchConfig(int grid, cudaStream_t stream, cudaLaunchAttribute* attr, bool pdl = false) {
  using C = GemmCfg<T, CM, TN, TMA, PP>;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid, 1, 1);
  cfg.blockDim = dim3(C::kThreads, 1, 1);
  cfg.dynamicSmemBytes = sizeof(typename C::SharedStorage);
  cfg.stream = stream;
  cfg.attrs = attr;
  if constexpr (CM > 1) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[cfg.numAttrs].val.clusterDim.x = CM;
    attr[cfg.numAttrs].val.clusterDim.y = 1;
    attr[cfg.numAttrs].val.clusterDim.z = 1;
    ++cfg.numAttrs;
  }
  if (pdl) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[cfg.numAttrs].val.programmaticStreamSerializationAllowed = 1;
    ++cfg.numAttrs;
  }
  return cfg;
}

// CTAs of the 2x1 cluster variants that can be resident at once, the least
// over the tile widths (after PreloadGemm).
template <class T>
cudaError_t GemmClusterCtas(int* ctas) {
  *ctas = 1 << 30;
  for (int tn : kTileNs) {
    const cudaError_t e = ForVariant(2, tn, false, false, [&]<int CM, int TN, bool TMA, bool PP>() {
      cudaLaunchAttribute attr[2];
      const cudaLaunchConfig_t cfg = LaunchConfig<T, CM, TN, TMA, PP>(2, nullptr, attr);
      int clusters = 0;
      const cudaError_t r = cudaOccupancyMaxActiveClusters(&clusters, OverlapGemmKernel<T, CM, TN, TMA, PP>, &cfg);
      *ctas = std::min(*ctas, 2 * clusters);
      return r;
    });
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// The tensor map of the output for the bulk tensor stores (TMA variants): the
// output as (n, mb, blocks) -- AG [P * mb, n]: one block per rank; RS [mb, n]
// -- so that a box below a row block's last row is clipped there, boxes of
// 64 columns x 128 rows (the staging tile's halves), 128-byte swizzle.
template <class T>
CUresult EncodeOutputMap(CUtensorMap* map, const GemmLaunch& l) {
  static_assert(sizeof(T) == 2, "bf16 or f16");
  const cuuint64_t blocks = l.kind == kAllGatherGemm ? uint64_t(l.nranks) : 1;
  const cuuint64_t dims[3] = {cuuint64_t(l.n), cuuint64_t(l.mb), blocks};
  const cuuint64_t strides[2] = {cuuint64_t(l.n) * sizeof(T), cuuint64_t(l.mb) * l.n * sizeof(T)};
  const cuuint32_t box[3] = {64, cuuint32_t(kTileM), 1};
  const CUtensorMapDataType type =
      std::is_same_v<T, cutlass::bfloat16_t> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(  // the driver entry point, as for A and W
      map, type, 3, l.out, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// Host: builds the per-block TMA descriptors (cached for the last operands of
// each device: XLA reuses buffer addresses, so steady-state calls encode
// nothing) and, for the TMA variants, the output's tensor map (likewise), and
// launches on `stream` (CM = 2: clusters of 2x1 CTAs, grid even).
template <class T, int CM, int TN, bool TMA, bool PP>
cudaError_t LaunchVariant(const GemmLaunch& l, cudaStream_t stream) {
  using C = GemmCfg<T, CM, TN, TMA, PP>;
  using Mainloop = typename C::Mainloop;
  static_assert(sizeof(typename C::SharedStorage) <= 232448, "shared memory over the sm90 limit");
  static_assert(sizeof(typename C::Params) <= 32000, "kernel parameters too large (CUDA >= 12.1 allows 32 KiB)");
  if (l.plan.grid <= 0 || l.plan.grid % CM != 0) return cudaErrorInvalidConfiguration;
  struct Cached {
    bool attr = false;
    const void* a[kMaxRanks] = {};
    const void* w = nullptr;
    int nranks = 0, mb = 0, n = 0, k = 0;
    typename Mainloop::Params ml[kMaxRanks];
    const void* out = nullptr;  // TMA: the output of out_map
    int out_kind = -1;
    CUtensorMap out_map;
  };
  static std::mutex mu;
  static Cached cache[64];  // per device ordinal
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  typename C::Params p;
  p.l = l;
  {
    std::lock_guard<std::mutex> lock(mu);
    Cached& c = cache[dev & 63];
    if (!c.attr) {  // per device (normally done by PreloadGemm already)
      e = PreloadVariant<T, CM, TN, TMA, PP>();
      if (e != cudaSuccess) return e;
      c.attr = true;
    }
    bool hit = c.w == l.w && c.nranks == l.nranks && c.mb == l.mb && c.n == l.n && c.k == l.k;
    for (int b = 0; hit && b < l.nranks; ++b) hit = c.a[b] == l.a[b];
    if (!hit) {
      for (int b = 0; b < l.nranks; ++b) {
        typename Mainloop::Arguments args{
            static_cast<const T*>(l.a[b]),
            cute::make_stride(int64_t(l.k), cute::Int<1>{}, int64_t(l.mb) * l.k),
            static_cast<const T*>(l.w),
            cute::make_stride(cute::Int<1>{}, int64_t(l.n), int64_t(l.n) * l.k)};
        c.ml[b] = Mainloop::to_underlying_arguments(cute::make_shape(l.mb, l.n, l.k, 1), args, nullptr);
        c.a[b] = l.a[b];
      }
      c.w = l.w; c.nranks = l.nranks; c.mb = l.mb; c.n = l.n; c.k = l.k;
    }
    for (int b = 0; b < l.nranks; ++b) p.ml[b] = c.ml[b];
    if constexpr (TMA) {
      if (!hit || c.out != l.out || c.out_kind != l.kind) {
        c.out = nullptr;
        if (EncodeOutputMap<T>(&c.out_map, l) != CUDA_SUCCESS) return cudaErrorInvalidValue;
        c.out = l.out;
        c.out_kind = l.kind;
      }
      p.out_map = c.out_map;
    }
  }
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = LaunchConfig<T, CM, TN, TMA, PP>(l.plan.grid, stream, attr, l.plan.pdl != 0);
  return cudaLaunchKernelEx(&cfg, OverlapGemmKernel<T, CM, TN, TMA, PP>, p);
}

// The launch's variant (the plan's schedule); the TMA variant where the plan picks it (LaunchPlan::
// tma_store: 1x1 clusters, every tile's destination this rank's output), not
// in the diagnostic without communication, and where the output can be
// described by a tensor map (16-byte aligned rows: n a multiple of 8); else
// the plain one.
template <class T>
cudaError_t LaunchGemm(const GemmLaunch& l, cudaStream_t stream) {
  const bool tma = l.plan.tma_store != 0 && !l.no_comm && l.n % 8 == 0 && reinterpret_cast<uintptr_t>(l.out) % 16 == 0;
  return ForVariant(l.plan.cluster_m, l.plan.tile_n, tma, l.plan.pingpong != 0,
                    [&]<int CM, int TN, bool TMA, bool PP>() { return LaunchVariant<T, CM, TN, TMA, PP>(l, stream); });
}

}  // namespace dfccl::overlap
