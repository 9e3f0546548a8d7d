// The fused Hopper GEMM of the overlap ops: CUTLASS 3 sm90 collective mainloop
// (TMA + WGMMA, warp-specialized cooperative: 1 producer + 2 consumer warp
// groups) inside our own persistent kernel, which adds
//   * a dynamic tile scheduler (atomic counter) over row blocks in the order of
//     the overlap schedule: AG: own block, then rank+1, ...; RS: rank+1, ...,
//     own block last.  Tiles (CM = 2: tile pairs) are handed out in that global
//     order, so a CTA only waits for peers once every earlier tile has been
//     taken by a running CTA (no deadlock however many CTAs are resident;
//     gemm_sched.cuh);
//   * AG: the producer waits for the arrival flag of a row chunk before its TMA
//     loads (rows pushed by the peer's PushKernel);
//   * RS: the epilogue of a peer's tile stores the bf16/f16 partial straight
//     into that peer's receive buffer (NVLink) and raises the tile's flag (or,
//     with the RS copy engine, stores it locally and counts it; the side
//     stream moves the finished block and raises the flags); the
//     own block's epilogue waits for the peers' flags of the tile and adds the
//     received partials to the f32 accumulator (no communication afterwards).
// Every row block is its own (mb x n x k) problem with its own TMA descriptor
// for A, so row blocks need not be multiples of the tile; TMA zero-fills out of
// bounds and the epilogue predicates its stores.
// Variants (template parameters): the tile width TN (GemmLaunch::tile_n, one
// of kTileNs; tiles are kTileM x TN, so the stage count follows from the
// shared memory: 4 stages at 256, 6 at 128), and the cluster shape CM
// (GemmLaunch::cluster_m): CM = 1 one CTA per tile; CM = 2 clusters of 2x1
// CTAs computing a pair of m tiles of one row block and n tile, the W tile
// multicast to both (gemm_sched.cuh: units, their order and the handoff of a
// unit between the cluster's CTAs).  CM = 1
// may split a partial last wave's tiles into k chunks, one unit each; the
// last chunk adds the others' f32 partials and runs the tile's epilogue as
// usual (gemm_sched.cuh, GemmLaunch::sk_units).
// TMA (LaunchPlan::tma_store, 1x1 clusters): a tile whose destination is
// this rank's own output (AG; RS on one rank) leaves the staging tile through
// bulk tensor stores (the tensor map of the output, bounds clipped per row
// block by its 3 dimensions) issued by one thread, in 64-column slices; the
// staging tile is then laid out as the 128-byte swizzle of the bulk copies (two
// 64-column halves of 128-byte rows), and its halves take the slices in turns,
// so the consumers stage a slice while the previous slice's store reads the
// other half, and wait only for the store before that.
// Ping-pong (LaunchPlan::pingpong, 1x1 clusters, 128-column tiles): the two
// consumer warp groups compute a whole tile each, the CTA's units alternating
// between them in the order the producer loads them (each group skips the
// other's units in the stage pipeline).  An ordered barrier of two stages
// makes their mainloops take turns on the tensor cores and their epilogues
// take turns on the one staging tile, so a group's epilogue runs during the
// other's mainloop instead of between two mainloops (CUTLASS's ping-pong
// kernel schedule, with our scheduler, signaling and epilogue).  A group
// waits for its bulk stores' reads of the staging tile before it hands the
// epilogue on.
// This file is the device side (the epilogue's staging and split partials in
// gemm_epilogue.cuh); the variants' loading, dispatch, descriptors and launch
// are in gemm_launch.cuh.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include <cuda.h>

#include <type_traits>

#include "overlap/gemm_epilogue.cuh"
#include "overlap/gemm_sched.cuh"
#include "overlap/launch.h"
#include "overlap/sync.cuh"

namespace dfccl::overlap {

template <class T, int CM, int TN, bool TMA = false, bool PP = false>
struct GemmCfg {
  static_assert(CM == 1 || CM == 2, "cluster shape 1x1 or 2x1");
  static_assert(!TMA || CM == 1, "bulk tensor stores on 1x1 clusters only");
  static_assert(!PP || (CM == 1 && TN == 128), "ping-pong on 1x1 clusters and 128-column tiles only");
  static constexpr bool kTma = TMA;
  static constexpr bool kPingpong = PP;
  static_assert(TN % 64 == 0 && TN >= kTileNMin && TN <= kTileNMax, "tile width: a multiple of 64 in 128..256");
  static constexpr int kTileN = TN;
  // The epilogue moves the tile in pieces of up to 128 columns (the staging
  // tile's width); a thread's accumulator values [64h, 64h + 64) hold the
  // columns [128h, 128h + 128) (cooperative; see the epilogue).
  static constexpr int kPieces = (TN + 127) / 128;
  // Warp groups that compute a tile of their own (ping-pong: both consumers).
  static constexpr int kMmaGroups = PP ? 2 : 1;
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<TN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::_1, cute::_1>;
  using OrderBarrier = cutlass::OrderedSequenceBarrier<2, 2>;  // ping-pong: mainloop, then epilogue, in turns
  struct Extra {  // our shared memory beside the mainloop's (carved out of the stages)
    typename cutlass::PipelineAsync<4>::SharedStorage sched;
    typename OrderBarrier::SharedStorage order;
    int tile_ids[4];
    Handoff handoff;  // CM = 2: units from cluster rank 0 (gemm_sched.cuh)
    uint64_t peer_recv[kMmaGroups][kMaxRanks];  // per warp group computing tiles (RS: once per peer)
    uint64_t peer_flags[kMmaGroups][kMaxRanks];
    int ready_ok[kMmaGroups][kMaxRanks];
    alignas(128) char stage[kTileM * 256 + (TMA ? 1024 : 0)];  // epilogue: 128 x 128 of T (StageChunk); TMA: from
                                                                // its first 1024-byte boundary
  };
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T,
      cutlass::layout::RowMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(Extra)) + 128>,
      std::conditional_t<PP, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative>>::CollectiveOp;
  using Pipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;
  using SchedPipeline = cutlass::PipelineAsync<4>;
  using TiledMma = typename Mainloop::TiledMma;
  static constexpr int kStages = Mainloop::DispatchPolicy::Stages;
  static constexpr int kMmaThreads = cute::size(TiledMma{});  // threads of one tile: 256, ping-pong 128
  static constexpr int kConsumerThreads = 256;                // both consumer warp groups
  static_assert(kMmaThreads * kMmaGroups == kConsumerThreads, "two consumer warp groups");
  static constexpr int kThreads = kConsumerThreads + 128;
  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
    alignas(128) Extra extra;
  };
  struct PlainParams {
    typename Mainloop::Params ml[kMaxRanks];  // per row block (A differs)
    GemmLaunch l;
  };
  struct TmaParams : PlainParams {
    alignas(64) CUtensorMap out_map;  // the output as (n, mb, blocks), boxes of 64 x 128 x 1 (EncodeOutputMap)
  };
  using Params = std::conditional_t<TMA, TmaParams, PlainParams>;
};
// The staging tile's alignment costs no pipeline stage.
static_assert(GemmCfg<cutlass::bfloat16_t, 1, 256, true>::kStages == GemmCfg<cutlass::bfloat16_t, 1, 256>::kStages &&
                  GemmCfg<cutlass::bfloat16_t, 1, 192, true>::kStages == GemmCfg<cutlass::bfloat16_t, 1, 192>::kStages &&
                  GemmCfg<cutlass::bfloat16_t, 1, 128, true>::kStages == GemmCfg<cutlass::bfloat16_t, 1, 128>::kStages &&
                  GemmCfg<cutlass::bfloat16_t, 1, 128, true, true>::kStages ==
                      GemmCfg<cutlass::bfloat16_t, 1, 128>::kStages,
              "the TMA and ping-pong variants keep the stage count");

// Every thread of the CTA before it exits (CM = 2): no CTA of a cluster
// exits while its peer may still multicast into its shared memory or arrive
// on its barriers.
template <int CM>
__device__ __forceinline__ void ClusterSyncBeforeExit() {
  if constexpr (CM > 1) {
    __syncwarp();
    cute::cluster_sync();
  }
}

template <class T, int CM, int TN, bool TMA, bool PP>
__global__ void __launch_bounds__(GemmCfg<T, CM, TN, TMA, PP>::kThreads, 1)
    OverlapGemmKernel(const __grid_constant__ typename GemmCfg<T, CM, TN, TMA, PP>::Params p) {
  using namespace cute;
  using C = GemmCfg<T, CM, TN, TMA, PP>;
  constexpr int kTileN = C::kTileN;
  using Mainloop = typename C::Mainloop;
  const GemmLaunch& l = p.l;
  extern __shared__ __align__(128) char smem_raw[];
  auto& ss = *reinterpret_cast<typename C::SharedStorage*>(smem_raw);

  const int thread_idx = threadIdx.x;
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  const int warp_group = cutlass::canonical_warp_group_idx();
  const int lane = cutlass::canonical_lane_idx();
  const int mt = (l.mb + kTileM - 1) / kTileM, nt = (l.n + kTileN - 1) / kTileN;
  const int per_block = mt * nt, total = l.nranks * per_block;
  const int units = l.plan.units;  // work units (gemm_sched.cuh), counted by the host
  const int k_tiles = (l.k + 63) / 64;
  const uint32_t crank = CM > 1 ? cute::block_rank_in_cluster() : 0u;

  if (warp_idx == 0 && cute::elect_one_sync())
    for (int b = 0; b < l.nranks; ++b) Mainloop::prefetch_tma_descriptors(p.ml[b]);
  if (thread_idx < C::kMmaGroups * kMaxRanks) ss.extra.ready_ok[thread_idx / kMaxRanks][thread_idx % kMaxRanks] = 0;

  typename C::Pipeline::Params pp;
  if (warp_group == 0 && warp_idx == 0) pp.role = C::Pipeline::ThreadCategory::Producer;
  if (warp_group > 0) pp.role = C::Pipeline::ThreadCategory::Consumer;
  pp.is_leader = (thread_idx % 128) == 0;
  pp.num_consumers = C::kMmaThreads;  // the consumers of a stage: one tile's
  pp.num_producers = Mainloop::NumProducerThreadEvents;
  pp.transaction_bytes = p.ml[0].tma_transaction_bytes;
  typename C::Pipeline pipeline(ss.pipeline, pp, typename C::ClusterShape{});

  typename C::SchedPipeline::Params sp;
  if (warp_group == 0 && warp_idx == 0) sp.role = C::SchedPipeline::ThreadCategory::Producer;
  if (warp_group > 0) sp.role = C::SchedPipeline::ThreadCategory::Consumer;
  sp.producer_arv_count = 1;
  sp.consumer_arv_count = C::kConsumerThreads;  // both groups read every unit (ping-pong: to skip the other's)
  typename C::SchedPipeline sched(ss.extra.sched, sp);
  // Ping-pong: consumer group g (0, 1) computes every other unit of this CTA.
  const int group = C::kPingpong && warp_group > 0 ? warp_group - 1 : 0;
  typename C::OrderBarrier::Params op;
  op.group_id = uint32_t(group);
  op.group_size = 128;
  typename C::OrderBarrier order(ss.extra.order, op);  // initialized by warp 0 (unused by the cooperative schedule)
  if (CM > 1 && thread_idx == 0) InitHandoff(ss.extra.handoff);
  cutlass::arch::fence_barrier_init();
  __syncthreads();
  if constexpr (CM > 1) {  // every barrier of the cluster initialized before any remote arrival or multicast
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  }
  // Launched with programmatic stream serialization (GemmLaunch::pdl), this
  // prologue overlaps the tail of the stream's previous kernel; nothing above
  // touches global memory.  From here on that kernel is complete and its
  // writes are visible (without the attribute the wait returns at once).
  GridDependencyWait();
  if (blockIdx.x == 0 && thread_idx == 0) {
    // Announce this instance to the peers in their own memory (protocol.h): all
    // prior work of this stream, the previous instance included, is complete.
    const uint64_t t_start = l.tl != nullptr ? GlobalTimer() : 0;
    for (int q = 0; q < l.nranks && !l.no_comm; ++q)
      if (q != l.rank && l.peer_ready[q] != nullptr) StReleaseSys(l.peer_ready[q] + l.rank, l.seq);
    if (l.tl != nullptr) {
      uint64_t* lr = l.tl + size_t(total) * kTlWords + size_t(kTlLaunch) * kTlSide;
      lr[0] = t_start;
      lr[1] = GlobalTimer();
    }
  }

  Mainloop collective;
  auto problem = make_shape(l.mb, l.n, l.k, 1);
  auto load_inputs = collective.load_init(problem, p.ml[0]);  // coordinate tensors only
  Tensor gA_mkl = get<0>(load_inputs);

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp_idx != 0) {
      ClusterSyncBeforeExit<CM>();
      return;
    }
    auto state = cutlass::make_producer_start_state<typename C::Pipeline>();
    auto sstate = cutlass::make_producer_start_state<typename C::SchedPipeline>();
    int hslot = 0;
    uint32_t hphase = 0;
    while (true) {
      int u = 0;
      if (lane == 0) {  // fetch the next unit and hand it to the consumers
        sched.producer_acquire(sstate);
        u = NextUnit<CM>(l, ss.extra.handoff, crank, hslot, hphase);
        ss.extra.tile_ids[sstate.index()] = u;
        sched.producer_commit(sstate);
      }
      ++sstate;
      u = __shfl_sync(0xffffffffu, u, 0);
      if (u >= units) {
        // This CTA takes no more work: the stream's next kernel may launch once
        // every CTA got here (it waits for this grid's completion before it
        // reads or writes memory: GridDependencyWait there), its CTAs filling
        // the SMs ours leave during the last wave.
        GridDependentsLaunch();
        break;
      }
      const Piece pc = UnitPiece<CM>(l, u, k_tiles);
      const TileCoord tc = Decode<CM>(l, pc.tile, mt, nt, int(crank));
      // AG: each CTA waits for the rows of its own m tile (none below the
      // block).  The peer CTA of a pair waits for the other chunk of the same
      // row block; the consumers of both need both CTAs' halves of W, so a
      // CTA may wait for its peer's chunk too: chunks are pushed by the peers'
      // side streams / push kernels, which do not wait for this GEMM's tiles,
      // so that wait ends (or times out) like the CTA's own.
      if (l.kind == kAllGatherGemm && tc.b != l.rank && !l.no_comm && tc.mi < mt) {
        if (lane == 0) {  // rows of chunk mi of block b pushed by rank b (release.sys)
          uint64_t* tl = l.tl != nullptr && !pc.partial
                             ? l.tl + TimelineRow<CM>(pc.tile, tc, mt, nt) * kTlWords : nullptr;
          if (tl) tl[4] = GlobalTimer();
          WaitGeq(l.local_flags + tc.b * mt + tc.mi, l.seq, l.mbox, l.timeout_ns, ErrorCode(kWaitRows, l.rank, tc.b));
          if (tl) tl[5] = GlobalTimer();
        }
        __syncwarp();
        FenceProxyAsyncGlobal();
      }
      auto k_iter = cute::make_coord_iterator(idx2crd(pc.k0, shape<3>(gA_mkl)), shape<3>(gA_mkl));
      collective.load(p.ml[tc.b], pipeline, state, load_inputs, make_coord(tc.mi, tc.ni, _, 0), k_iter, pc.kn,
                      lane, crank, ss.tensors);
      state.advance(pc.kn);
    }
    collective.load_tail(pipeline, state);
    ClusterSyncBeforeExit<CM>();
    return;
  }

  // Consumers: MMA + epilogue.
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int mma_tid = (thread_idx - 128) % C::kMmaThreads;  // within the threads of this tile
  typename C::TiledMma tiled_mma;
  typename C::PipelineState state;
  typename C::SchedPipeline::PipelineState sstate;
  Tensor cD = make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{}));
  Tensor tCcD = tiled_mma.get_slice(mma_tid).partition_C(cD);
  T* out = static_cast<T*>(l.out);
  // The staging tile (recomputed where used: nothing held across the mainloop).
  auto stage_tile = [&]() -> char* {
    if constexpr (C::kTma) {  // its first 1024-byte boundary (an offset in the shared window: 32-bit addresses)
      const uint32_t a = SmemAddr(ss.extra.stage);
      return ss.extra.stage + (((a + 1023u) & ~1023u) - a);
    } else
      return ss.extra.stage;
  };
  auto* peer_recv = ss.extra.peer_recv[group];
  auto* peer_flags = ss.extra.peer_flags[group];
  int* ready_ok = ss.extra.ready_ok[group];
  // Ping-pong: the units this CTA took, counted in the order of the stages.
  uint32_t taken = 0;
  // Bulk stores (cooperative): the staging half that takes the next 64-column slice (0, 1 in turns
  // across tiles, so a slice waits only for the store before the previous one).
  uint32_t half_turn = 0;
  while (true) {
    sched.consumer_wait(sstate);
    const int u = ss.extra.tile_ids[sstate.index()];
    sched.consumer_release(sstate);
    ++sstate;
    if (u >= units) break;
    const Piece pc = UnitPiece<CM>(l, u, k_tiles);
    if constexpr (C::kPingpong) {
      if (int(taken++ & 1u) != group) {  // the other group's unit: its stages are not ours
        state.advance(pc.kn);
        continue;
      }
    }
    const TileCoord tc = Decode<CM>(l, pc.tile, mt, nt, int(crank));
    const bool in_block = tc.mi < mt;  // CM = 2: false for the empty second tile of a pair
    uint64_t* tl = l.tl != nullptr && mma_tid == 0 && in_block && !pc.partial
                       ? l.tl + TimelineRow<CM>(pc.tile, tc, mt, nt) * kTlWords : nullptr;
    if (tl) tl[0] = GlobalTimer();
    auto acc = partition_fragment_C(tiled_mma, take<0, 2>(typename C::TileShape{}));
    if constexpr (C::kPingpong) order.wait();  // the other group's mainloop issued
    collective.mma(pipeline, state, acc, pc.kn, mma_tid, ss.tensors, p.ml[tc.b]);
    if constexpr (C::kPingpong) order.arrive();  // the other group's mainloop may start
    collective.mma_tail(pipeline, state, pc.kn);
    state.advance(pc.kn);
    if (tl) tl[1] = tl[2] = GlobalTimer();
    if constexpr (C::kPingpong) order.wait();  // the other group's epilogue done with the staging tile
    // The epilogue (a block left by `break` where a unit stores nothing or only its split partial).
    do {
      if (!in_block) break;  // its stages are released (the peer's multicast); nothing to store
      if (pc.partial) {  // split tile: the accumulator to this unit's slot, then its flag (no epilogue)
        SkStorePartial<C::kMmaThreads>(l.sk_partials + size_t(pc.slot) * kTileM * kTileN, acc, mma_tid);
        ConsumerBarrier(C::kMmaThreads, group);  // every thread's stores, then one cumulative fence + flag
        if (mma_tid == 0) {
          FenceAcqRelGpu();
          StRelaxedGpu(l.sk_flags + pc.slot, l.seq);
        }
        break;
      }
      if (pc.wait_n > 0) {  // split tile's owner: add the earlier chunks' partials (chunk order)
        if (mma_tid == 0)
          for (int i = 0; i < pc.wait_n; ++i)
            WaitGeq(l.sk_flags + pc.wait_first + i * l.plan.sk_tiles, l.seq, l.mbox, l.timeout_ns,
                    ErrorCode(kWaitSplit, l.rank, l.rank));
        ConsumerBarrier(C::kMmaThreads, group);
        for (int i = 0; i < pc.wait_n; ++i)
          SkAddPartial<C::kMmaThreads>(
              l.sk_partials + size_t(pc.wait_first + i * l.plan.sk_tiles) * kTileM * kTileN, acc, mma_tid);
      }

      if constexpr (C::kTma && !C::kPingpong) {
        // Every tile's destination is this rank's output (LaunchGemm picks this variant only for AG and for RS on one
        // rank): the tile leaves in 64-column slices through bulk tensor stores, one thread issuing them.  The
        // staging tile's two halves take the slices in turns, so a slice is staged while the previous one's store
        // reads the other half; before writing a half the consumers wait only for the store that read it last
        // (all but the most recent bulk group: the one of the other half).
        CUTLASS_PRAGMA_UNROLL
        for (int q = 0; q < kTileN / 64; ++q) {
          char* half = stage_tile() + half_turn * (kTileM * 128);
          half_turn ^= 1u;
          if (mma_tid == 0) cute::tma_store_wait<1>();
          ConsumerBarrier(C::kMmaThreads, group);
          // The slice's accumulator values: [32q, 32q + 32) (piece q / 2, its half q % 2; StagePiece).
          StagePiece<true, T>(half, acc, tCcD, 32 * q, 32 * q + 32, 64 * q);
          cute::tma_store_fence();  // these generic stores, visible to the bulk copies
          ConsumerBarrier(C::kMmaThreads, group);
          if (mma_tid == 0) {  // clipped at the row block's and the output's bounds
            cute::SM90_TMA_STORE_3D::copy(&p.out_map, half, tc.ni * kTileN + 64 * q, tc.mi * kTileM, tc.b);
            cute::tma_store_arrive();
          }
        }
      } else if constexpr (C::kTma) {
        // Ping-pong: the group's 128 x 128 tile in one piece, both 64-column halves (the other group's
        // epilogue waits for these stores' reads: below).
        static_assert(C::kPingpong && kTileN == 128, "the cooperative schedule's bulk stores are the slices above");
        if (mma_tid == 0) cute::tma_store_wait<0>();  // the previous tile's stores read the staging tile
        ConsumerBarrier(C::kMmaThreads, group);
        StageTilePiece<true, true, T, kTileN>(stage_tile(), acc, tCcD, 0);
        cute::tma_store_fence();  // these generic stores, visible to the bulk copies
        ConsumerBarrier(C::kMmaThreads, group);
        if (mma_tid == 0) {  // clipped at the row block's and the output's bounds
          for (int half = 0; half < 2; ++half)
            cute::SM90_TMA_STORE_3D::copy(&p.out_map, stage_tile() + half * (kTileM * 128), tc.ni * kTileN + 64 * half,
                                          tc.mi * kTileM, tc.b);
          cute::tma_store_arrive();
        }
      } else {
        const int rows = min(kTileM, l.mb - tc.mi * kTileM), cols = min(kTileN, l.n - tc.ni * kTileN);
        const size_t tile_off = size_t(tc.mi) * kTileM * l.n + size_t(tc.ni) * kTileN;
        const int tile_idx = tc.mi * nt + tc.ni;
        const bool rs = l.kind == kGemmReduceScatter && !l.no_comm;
        T* dst = nullptr;
        if (rs && tc.b != l.rank && l.send != nullptr) {  // copy engine moves it (2 ranks: one peer block)
          dst = static_cast<T*>(l.send) + tile_off;
        } else if (rs && tc.b != l.rank) {  // partial for rank b: its recv slot `rank`
          if (mma_tid == 0 && !ready_ok[tc.b]) {  // once per CTA (ping-pong: per group) and peer
            const bool ok = WaitReady(l.ready_in != nullptr ? l.ready_in + tc.b : nullptr, &l.mbox->ready[tc.b], l.seq,
                                      l.mbox, l.timeout_ns, ErrorCode(kWaitReady, l.rank, tc.b));
            // Addresses from the host once known there, else from the mailbox
            // (published before the peer's first ready write).
            const uint64_t recv = l.peer_recv[tc.b] != 0 ? l.peer_recv[tc.b] : LoadMailboxPtr(&l.mbox->recv[tc.b]);
            const uint64_t flags = l.peer_flags[tc.b] != 0 ? l.peer_flags[tc.b] : LoadMailboxPtr(&l.mbox->flags[tc.b]);
            peer_recv[tc.b] = ok ? recv : 0;
            peer_flags[tc.b] = ok ? flags : 0;
            ready_ok[tc.b] = ok ? 1 : 2;
          }
          ConsumerBarrier(C::kMmaThreads, group);
          if (tl) tl[2] = GlobalTimer();
          if (peer_recv[tc.b] != 0)
            dst = reinterpret_cast<T*>(peer_recv[tc.b]) + size_t(l.rank) * l.mb * l.n + tile_off;
        } else if (rs) {  // own block: fold in the peers' partials (waited for below)
          dst = out + tile_off;
        } else if (l.kind == kGemmReduceScatter) {  // no_comm diagnostic: every block to the local recv buffer
          dst = const_cast<T*>(static_cast<const T*>(l.local_recv)) + size_t(tc.b) * l.mb * l.n + tile_off;
        } else {
          dst = out + size_t(tc.b) * l.mb * l.n + tile_off;
        }
        const bool fold = rs && tc.b == l.rank && l.nranks > 1;  // one rank: nothing to fold in
        // Epilogue through shared memory, in two halves of 128 columns: the
        // accumulator (rounded to T) goes to a swizzled 128 x 128 staging tile,
        // then every thread moves 16-byte vectors, a warp two contiguous 256-byte
        // row pieces (local HBM or, for a peer's partial, NVLink).  The own RS
        // block adds the peers' partials (16-byte loads) in f32 on the way.
        // WGMMA accumulator layout (64xN atom, 2 consumer warp groups along M):
        // a thread holds TN / 2 values, [64h, 64h + 64) the columns [128h, 128h +
        // 128) (TN = 192: the second piece is 64 columns wide, values [64, 96)).
        // Ping-pong: one group's 128 x 128 tile, one piece (StageTilePiece).
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < C::kPieces; ++h) {
          ConsumerBarrier(C::kMmaThreads, group);  // the previous piece / tile was read out
          StageTilePiece<false, C::kPingpong, T, kTileN>(stage_tile(), acc, tCcD, h);
          ConsumerBarrier(C::kMmaThreads, group);
          if (fold && h == 0 && mma_tid < l.nranks && mma_tid != l.rank)  // peers' partials of this tile arrived
            WaitGeq(l.local_flags + mma_tid * per_block + tile_idx, l.seq, l.mbox, l.timeout_ns,
                    ErrorCode(kWaitPartial, l.rank, mma_tid));
          if (fold && h == 0) {
            ConsumerBarrier(C::kMmaThreads, group);
            if (tl) tl[2] = GlobalTimer();
          }
          constexpr int kVecs = (kTileM * 16) / C::kMmaThreads;
          if (dst != nullptr && !fold) {
            // Plain stores: one short unrolled loop, contiguous in the code (the
            // fold's longer body is a separate loop below, so this path's
            // instructions are fetched in one run, not between fold blocks).
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kVecs; ++j) {
              const int idx = j * C::kMmaThreads + mma_tid, r = idx >> 4, ch = idx & 15;
              const int col = 128 * h + ch * 8;
              if (r < rows && col < cols)  // cols % 8 == 0: a chunk is all in or all out
                *reinterpret_cast<uint4*>(dst + size_t(r) * l.n + col) =
                    *reinterpret_cast<const uint4*>(stage_tile() + StageChunk<false>(r, ch));
            }
          } else if (dst != nullptr) {
            // Fold: the first peer's partials of this half are loaded up front (all
            // kVecs 16-byte loads in flight at once, not one per store).
            const int q0 = l.rank == 0 ? 1 : 0;
            uint4 pre[kVecs];
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kVecs; ++j) {
              const int idx = j * C::kMmaThreads + mma_tid, r = idx >> 4, col = 128 * h + (idx & 15) * 8;
              pre[j] = make_uint4(0, 0, 0, 0);
              if (r < rows && col < cols)
                pre[j] = *reinterpret_cast<const uint4*>(static_cast<const T*>(l.local_recv) + size_t(q0) * l.mb * l.n +
                                                         tile_off + size_t(r) * l.n + col);
            }
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kVecs; ++j) {
              const int idx = j * C::kMmaThreads + mma_tid, r = idx >> 4, ch = idx & 15;
              const int col = 128 * h + ch * 8;
              if (r >= rows || col >= cols) continue;
              uint4 v = *reinterpret_cast<const uint4*>(stage_tile() + StageChunk<false>(r, ch));
              float f[8];
              const T* pv = reinterpret_cast<const T*>(&v);
              for (int e = 0; e < 8; ++e) f[e] = float(pv[e]);
              for (int q = 0; q < l.nranks; ++q) {
                if (q == l.rank) continue;
                const uint4 u = q == q0 ? pre[j]
                                        : *reinterpret_cast<const uint4*>(static_cast<const T*>(l.local_recv) +
                                                                          size_t(q) * l.mb * l.n + tile_off +
                                                                          size_t(r) * l.n + col);
                const T* pu = reinterpret_cast<const T*>(&u);
                for (int e = 0; e < 8; ++e) f[e] += float(pu[e]);
              }
              T* pw = reinterpret_cast<T*>(&v);
              for (int e = 0; e < 8; ++e) pw[e] = T(f[e]);
              *reinterpret_cast<uint4*>(dst + size_t(r) * l.n + col) = v;
            }
          }
        }
        if (rs && tc.b != l.rank && l.send != nullptr) {
          ConsumerBarrier(C::kMmaThreads, group);  // the tile's local stores, then one cumulative fence + count
          if (mma_tid == 0) {
            FenceAcqRelSys();
            atomicAdd(l.done_counter, 1u);
          }
        } else if (rs && tc.b != l.rank) {
          if (l.thread_fences) __threadfence_system();  // every storing thread: its remote stores before the flag
          ConsumerBarrier(C::kMmaThreads, group);              // all stores of the tile issued (CTA-ordered before ...)
          if (mma_tid == 0 && peer_flags[tc.b] != 0) {
            uint32_t* flag = reinterpret_cast<uint32_t*>(peer_flags[tc.b]) + l.rank * per_block + tile_idx;
            if (l.thread_fences) {
              StReleaseSys(flag, l.seq);
            } else {  // ... this one cumulative system fence, then a strong store (release pattern)
              FenceAcqRelSys();
              StRelaxedSys(flag, l.seq);
            }
          }
        }
      }
      if (tl) {
        tl[3] = GlobalTimer();  // TMA: the tile's stores issued
        uint32_t sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        tl[6] = sm;
      }
    } while (false);
    if constexpr (C::kPingpong) {
      if constexpr (C::kTma)  // the bulk stores' reads of the staging tile, before the other group writes it
        if (mma_tid == 0) cute::tma_store_wait<0>();
      order.arrive();
    }
  }
  if constexpr (C::kTma)  // every bulk store complete before the CTA (and its shared memory) goes
    if (mma_tid == 0) TmaStoreWaitWrites();
  ClusterSyncBeforeExit<CM>();
}

}  // namespace dfccl::overlap
