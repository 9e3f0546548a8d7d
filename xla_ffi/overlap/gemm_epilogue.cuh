// Device helpers of the fused GEMM's epilogue (gemm.cuh): the staging tile's
// layout and the accumulator's writes into it (`stmatrix`), the consumers'
// named barrier, the bulk stores' completion, and the split last wave's f32
// partials (gemm_sched.cuh).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "overlap/gemm_sched.cuh"
#include "overlap/protocol.h"

namespace dfccl::overlap {

// Byte offset of the 16-byte chunk `ch` (0..15) of row r in the epilogue's
// staging tile (128 rows x 128 columns of a 2-byte type), swizzled so that a
// warp's stores and loads meet no bank conflict: rows of 256 bytes, or with
// kTma the bulk copies' 128-byte swizzle (two 64-column halves of 128-byte
// rows; the buffer 1024-byte aligned).
template <bool kTma>
__device__ __forceinline__ int StageChunk(int r, int ch) {
  if constexpr (kTma) return (ch >> 3) * (kTileM * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
  else return r * 256 + ((ch ^ (r & 7)) << 4);
}

// A piece of a consumer thread's accumulator, its values [v0, v1) (v0 a
// multiple of 32, at most 64 values: one 16-row slab of the warp, the columns
// [c0, c0 + 2 (v1 - v0)), v0's column c0), rounded to T, into the staging tile in the layout of
// StageChunk<kTma>, by `stmatrix` (four 8x8 matrices per instruction).  The
// WGMMA accumulator of a warp is a 16-row slab per 64 x N atom: value
// 4j + 2v + e of lane l sits at row l / 4 + 8v, column 8j + 2(l % 4) + e (the
// mma C fragment, which is stmatrix's), so values 8q .. 8q + 7 of every lane
// are the four matrices (rows 0-7 | 8-15) x (chunk 2q | 2q + 1), and lane l
// names row l % 8 of matrix l / 8.  `coords` maps a value to its (row,
// column): the slab's first row and each step's chunk come from it.  The
// cooperative schedule's piece h is values [64h, 64h + 64) (columns [128h,
// 128h + 128)); ping-pong's 128 x 128 tile is two pieces, values [0, 64) and
// [64, 128) (rows 64 apart).  (CuTe's SM90_U32x4_STSM_N issues the same
// instruction without a memory clobber; the barrier after the piece must not
// be passed by these stores.)
template <bool kTma, class T, class Acc, class Coords>
__device__ __forceinline__ void StagePiece(char* stage, const Acc& acc, const Coords& coords, int v0, int v1, int c0) {
  const int lane = static_cast<int>(threadIdx.x & 31u), m = lane >> 3;
  const int row = cute::get<0>(coords(v0)) - (lane >> 2) + (m & 1) * 8 + (lane & 7);  // of the matrix row it names
  auto pack = [&](int i) { return uint32_t(T(acc(i)).raw()) | (uint32_t(T(acc(i + 1)).raw()) << 16); };
  // A fixed trip count, so that the loop unrolls and every acc index is a
  // constant once the caller's piece loop is unrolled (else the accumulator
  // goes to the stack).
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 64; j += 8) {
    const int i = v0 + j;
    if (i >= v1) break;
    const int ch = ((cute::get<1>(coords(i)) - c0) >> 3) + (m >> 1);
    const uint32_t addr = SmemAddr(stage + StageChunk<kTma>(row, ch));
    asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(pack(i)),
                 "r"(pack(i + 2)), "r"(pack(i + 4)), "r"(pack(i + 6))
                 : "memory");
  }
}

// Piece h of a tile into the staging tile: cooperative, the columns [128h,
// 128h + 128) (the rows of both groups); ping-pong (TN = 128, h = 0), the
// group's whole tile, its two 64-row slabs.
template <bool kTma, bool kPingpong, class T, int TN, class Acc, class Coords>
__device__ __forceinline__ void StageTilePiece(char* stage, const Acc& acc, const Coords& coords, int h) {
  if constexpr (kPingpong) {
    StagePiece<kTma, T>(stage, acc, coords, 0, 64, 0);
    StagePiece<kTma, T>(stage, acc, coords, 64, 128, 0);
  } else {
    StagePiece<kTma, T>(stage, acc, coords, 64 * h, 64 * h + 64 < TN / 2 ? 64 * h + 64 : TN / 2, 128 * h);
  }
}

// The bulk tensor stores are CuTe's (cute::SM90_TMA_STORE_3D, tma_store_fence /
// _arrive / _wait: the reads of shared memory); this waits for their writes too.
__device__ __forceinline__ void TmaStoreWaitWrites() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// The consumers of one tile (ping-pong: warp group g of the two; ids 8 and 9
// are unused by CUTLASS here).
__device__ __forceinline__ void ConsumerBarrier(int threads, int group = 0) {
  asm volatile("bar.sync %0, %1;" ::"r"(8 + group), "r"(threads) : "memory");
}

// Partials of a split last wave (gemm_sched.cuh): the accumulator fragment of each
// consumer thread, 16-byte vectors interleaved over the threads ([i / 4][tid]
// [4] floats: a warp's stores are contiguous), at L2 (.cg: the owner on
// another SM reads them after the flag).  Four vectors per step in flight.
template <int kThreads, class Acc>
__device__ __forceinline__ void SkStorePartial(float* slot, const Acc& acc, int tid) {
  float4* p = reinterpret_cast<float4*>(slot) + tid;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < int(cute::size(acc)); i += 4)
    __stcg(p + (i / 4) * kThreads, make_float4(acc(i), acc(i + 1), acc(i + 2), acc(i + 3)));
}
template <int kThreads, class Acc>
__device__ __forceinline__ void SkAddPartial(const float* slot, Acc& acc, int tid) {
  const float4* p = reinterpret_cast<const float4*>(slot) + tid;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < int(cute::size(acc)); i += 16) {
    float4 v[4];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 4; ++j) v[j] = __ldcg(p + (i / 4 + j) * kThreads);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 4; ++j) {
      acc(i + 4 * j) += v[j].x;
      acc(i + 4 * j + 1) += v[j].y;
      acc(i + 4 * j + 2) += v[j].z;
      acc(i + 4 * j + 3) += v[j].w;
    }
  }
}

}  // namespace dfccl::overlap
