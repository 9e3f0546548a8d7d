// Tile scheduler of the fused overlap GEMM (gemm.cuh): work units handed out
// by an atomic counter in the order of the overlap schedule, and (cluster
// variant, CM = 2) the handoff of a unit from cluster rank 0 to its peer.
//
// A work unit is CM m tiles of one row block and one n tile: CM = 1 one
// tile; CM = 2 the pair of m tiles 2i and 2i + 1 that the two CTAs of a 2x1
// cluster compute together (the W tile is loaded once per cluster, each CTA
// issuing half of it with TMA multicast to both).  The second tile of a pair
// lies entirely below the row block when the block has an odd number of m
// tiles: TMA zero-fills its A rows, its CTA still runs the mainloop (its
// consumers release the multicast stages of both CTAs) and skips the epilogue.
//
// Order: units go block by block in the overlap order (AG: own block, then
// rank+1, ...; RS: rank+1, ..., own block last), so a unit is only handed out
// once every earlier unit has been taken by a running CTA (CM = 2: a running
// cluster; both CTAs of a cluster are co-scheduled).  A unit whose CTA waits
// for peers (RS: the own block's epilogue waits for the peers' partials; AG:
// the producer waits for pushed rows) waits for work that does not wait for
// this GEMM (the peers' blocks computed by the peers' GEMMs, whose waits end
// without this rank's progress; the peers' pushes), however many CTAs are
// resident.  Both CTAs of a pair belong to the same row block, so a pair never
// ties a CTA with waits to a CTA of an earlier segment.
//
// Split last wave (CM = 1, GemmLaunch::sk_units > 0; the host chooses it
// when the last wave of whole tiles would leave many SMs idle): the first
// units - sk_units units are whole tiles 0, 1, ... of the order above; the
// last sk_units = s x sk_tiles units split the last sk_tiles tiles into s
// equal k ranges, chunk-major: unit dp + c x sk_tiles + t takes chunk c of
// tile dp + t.  Units of one chunk run side by side, so the m tiles of a
// weight column still read the same k range of it at the same time (L2
// reuse; a stream-K split at other offsets per tile read the weights up to
// m-tiles times from memory and was slower).  Chunks 0 .. s-2 are partials:
// the f32 accumulator goes to the unit's slot, then its flag.  The last chunk
// owns the tile: it waits for the tile's partials, adds them (in chunk order)
// and runs the tile's epilogue (store, RS signal or fold: unchanged, so a
// tile's flag still covers the whole tile).  An owner waits only for units
// before it, which were taken earlier by running CTAs (or by the same CTA,
// whose consumers finished them), so the lowest unfinished unit never waits
// on unfinished work: no deadlock.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "overlap/protocol.h"

namespace dfccl::overlap {

constexpr int kHandoffSlots = 4;

// Unit index -> (segment s of the overlap order, row block, m tile, n tile).
// Within a row block, units go in groups of LaunchPlan::raster.group_n n
// tiles (0: all), a group at a time, so that the ~132 resident tiles share few
// A and W panels (L2 reuse); inside a group m outer and n inner, or with
// raster.m_fast n outer and m inner (protocol.h kRasters).  crank: the CTA's
// rank in its cluster (the pair's tile 2i + crank).
struct TileCoord {
  int s, b, mi, ni;
};
template <int CM>
__device__ __forceinline__ TileCoord Decode(const GemmLaunch& l, int u, int mt, int nt, int crank) {
  const int mu = (mt + CM - 1) / CM, per = mu * nt, s = u / per, rem = u % per;
  const int b = l.kind == kAllGatherGemm ? (l.rank + s) % l.nranks : (l.rank + 1 + s) % l.nranks;
  const int gn = l.plan.raster.group_n > 0 ? min(l.plan.raster.group_n, nt) : nt;
  const int g = rem / (mu * gn), in = rem % (mu * gn);
  const int gw = min(gn, nt - g * gn);
  if (l.plan.raster.m_fast) return {s, b, (in % mu) * CM + crank, g * gn + in / mu};
  return {s, b, (in / gw) * CM + crank, g * gn + in % gw};
}

// The work of a unit: k iterations [k0, k0 + kn) of tile `tile` (its CM = 1
// unit index; CM = 2: the pair unit).  Split last wave: a partial leaves its
// accumulator in slot `slot`; an owner adds slots wait_first + i x sk_tiles,
// i < wait_n.
struct Piece {
  int tile, k0, kn, slot, wait_first, wait_n;
  bool partial;
};

template <int CM>
__device__ __forceinline__ Piece UnitPiece(const GemmLaunch& l, int u, int kt) {
  const int dp = l.plan.units - l.plan.sk_units;
  if (CM > 1 || u < dp) return {u, 0, kt, -1, 0, 0, false};
  const int j = u - dp, R = l.plan.sk_tiles, s = l.plan.sk_units / R, c = j / R, t = j % R;
  const int k0 = c * kt / s, k1 = (c + 1) * kt / s;
  const bool owner = c == s - 1;
  return {dp + t, k0, k1 - k0, j, t, owner ? s - 1 : 0, !owner};
}

// Timeline row of a tile (profile.cc reads row / per_block as the segment):
// CM = 1 the unit index itself, CM = 2 the tile's place in its segment.
template <int CM>
__device__ __forceinline__ size_t TimelineRow(int u, const TileCoord& tc, int mt, int nt) {
  return CM == 1 ? size_t(u) : size_t(tc.s) * mt * nt + size_t(tc.mi) * nt + tc.ni;
}

// Cluster handoff (distributed shared memory): rank 0's producer lane takes
// the unit from the counter, stores it into the peer's slot and arrives on the
// peer's `full` barrier (release, cluster scope); the peer's producer lane
// waits on it (acquire, cluster scope), reads the slot and arrives on rank 0's
// `empty` barrier of the slot.  Both barriers count one arrival per phase.
struct Handoff {
  uint64_t full[kHandoffSlots];
  uint64_t empty[kHandoffSlots];
  int ids[kHandoffSlots];
};

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t PeerAddr(uint32_t local, uint32_t cta) {  // same offset in CTA `cta`
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(cta));
  return r;
}
__device__ __forceinline__ void ArriveRemote(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void WaitCluster(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "HANDOFF_WAIT_%=:\n"
      " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra HANDOFF_WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void InitHandoff(Handoff& h) {  // one thread, before the cluster barrier
  for (int i = 0; i < kHandoffSlots; ++i) {
    cutlass::arch::ClusterBarrier::init(&h.full[i], 1);
    cutlass::arch::ClusterBarrier::init(&h.empty[i], 1);
  }
}

// The next unit of this CTA (one lane of the producer warp).  `slot` and
// `phase` start at 0 and advance with every call.
template <int CM>
__device__ __forceinline__ int NextUnit(const GemmLaunch& l, Handoff& h, uint32_t crank, int& slot,
                                        uint32_t& phase) {
  if constexpr (CM == 1) {
    return static_cast<int>(atomicAdd(l.tile_counter, 1u) - l.tile_base);
  } else {
    int u;
    if (crank == 0) {
      WaitCluster(SmemAddr(&h.empty[slot]), phase ^ 1u);  // the peer read this slot's previous unit
      u = static_cast<int>(atomicAdd(l.tile_counter, 1u) - l.tile_base);
      asm volatile("st.shared::cluster.s32 [%0], %1;" ::"r"(PeerAddr(SmemAddr(&h.ids[slot]), 1)), "r"(u)
                   : "memory");
      ArriveRemote(PeerAddr(SmemAddr(&h.full[slot]), 1));
    } else {
      WaitCluster(SmemAddr(&h.full[slot]), phase);
      u = *reinterpret_cast<volatile int*>(&h.ids[slot]);
      ArriveRemote(PeerAddr(SmemAddr(&h.empty[slot]), 0));
    }
    if (++slot == kHandoffSlots) {
      slot = 0;
      phase ^= 1u;
    }
    return u;
  }
}

}  // namespace dfccl::overlap
