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
// Stream-K (CM = 1, GemmLaunch::sk_units > 0; the host chooses it when the
// last wave of whole tiles would leave many SMs idle): the first
// units - sk_units units are whole tiles 0, 1, ... of the order above; the
// last sk_units units share the last sk_tiles tiles (sk_units > sk_tiles),
// unit j taking k iterations [j I / S, (j + 1) I / S) of the I = sk_tiles x
// k_tiles iterations of those tiles laid end to end (S = sk_units).  So a unit
// covers at most two pieces: the end of one tile and the start of the next.
// A piece that holds its tile's last k iteration owns the tile: it waits for
// the partial accumulators of the earlier units that hold the rest of it,
// adds them and runs the tile's epilogue (store, RS signal or fold: unchanged,
// so a tile's flag still covers the whole tile).  A piece that ends inside its
// tile is a partial: its f32 accumulator goes to the unit's slot, then a flag.
// A unit runs its partial piece first (it waits for nothing), its owned piece
// second; an owner waits only for units before it, which were taken earlier
// by running CTAs (or by the same CTA, whose consumers finished them), so the
// lowest unfinished unit never waits on unfinished work: no deadlock.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "overlap/protocol.h"

namespace dfccl::overlap {

constexpr int kGroupN = 8;
constexpr int kHandoffSlots = 4;

// Unit index -> (segment s of the overlap order, row block, m tile, n tile).
// Within a row block, units go in groups of kGroupN n tiles, m units outer
// inside a group, so that the ~132 resident tiles share few A and W panels
// (L2 reuse).  crank: the CTA's rank in its cluster (the pair's tile 2i + crank).
struct TileCoord {
  int s, b, mi, ni;
};
template <int CM>
__device__ __forceinline__ TileCoord Decode(const GemmLaunch& l, int u, int mt, int nt, int crank) {
  const int mu = (mt + CM - 1) / CM, per = mu * nt, s = u / per, rem = u % per;
  const int b = l.kind == kAllGatherGemm ? (l.rank + s) % l.nranks : (l.rank + 1 + s) % l.nranks;
  const int g = rem / (mu * kGroupN), in = rem % (mu * kGroupN);
  const int gw = min(kGroupN, nt - g * kGroupN);
  return {s, b, (in / gw) * CM + crank, g * kGroupN + in % gw};
}

// One piece of a unit's work: k iterations [k0, k0 + kn) of tile `tile` (its
// CM = 1 unit index; CM = 2: the pair unit).  Stream-K: `slot` is the unit's
// partial slot; an owner with wait_lo >= 0 adds slots [wait_lo, slot).
struct Piece {
  int tile, k0, kn, slot, wait_lo;
  bool partial, valid;
};

__device__ __forceinline__ int64_t SkStart(int j, int64_t iters, int units) { return int64_t(j) * iters / units; }

// The stream-K unit whose range holds iteration x.
__device__ __forceinline__ int SkUnitOf(int64_t x, int64_t iters, int units) {
  int j = int(x * units / iters);
  while (j + 1 < units && SkStart(j + 1, iters, units) <= x) ++j;
  while (j > 0 && SkStart(j, iters, units) > x) --j;
  return j;
}

// Piece p (0, 1) of unit u, in processing order; invalid past the last.
template <int CM>
__device__ __forceinline__ Piece UnitPiece(const GemmLaunch& l, int u, int p, int kt) {
  Piece pc{u, 0, kt, -1, -1, false, p == 0};
  const int dp = l.units - l.sk_units;
  if (CM > 1 || u < dp) return pc;
  const int S = l.sk_units, j = u - dp;
  const int64_t iters = int64_t(l.sk_tiles) * kt, s = SkStart(j, iters, S), e = SkStart(j + 1, iters, S);
  const int ts = int(s / kt), te = int((e - 1) / kt);  // te <= ts + 1: a range is at most kt long
  const int pieces = te > ts ? 2 : 1;
  pc.valid = p < pieces;
  // Processing order: the second piece of the range first when it is a partial.
  const int which = pieces == 1 ? 0 : (e % kt != 0 ? 1 - p : p);
  const int t = which == 0 ? ts : te;
  const int64_t lo = which == 0 ? s : int64_t(te) * kt;
  const int64_t hi = which == 0 ? (e < int64_t(ts + 1) * kt ? e : int64_t(ts + 1) * kt) : e;
  pc.tile = dp + t;
  pc.k0 = int(lo - int64_t(t) * kt);
  pc.kn = int(hi - lo);
  pc.slot = j;
  pc.partial = hi % kt != 0;
  if (!pc.partial && pc.k0 > 0) pc.wait_lo = SkUnitOf(int64_t(t) * kt, iters, S);
  return pc;
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
