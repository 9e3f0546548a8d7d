// The NVSHMEM engine under the transport contract of transport/transport.cuh
// (docs/design/scale-out.md §5.1): ranks are PEs; rank r's region lies in one
// symmetric allocation (`heap`, made by every PE at once) at offset at[r] (its
// process's share of it: the processes carve their communicators' regions in
// their own orders, so the offsets differ by rank and travel in the exchange
// blob).  `heap + at[r] + off` is a symmetric address that NVSHMEM resolves on
// rank r's PE.  Compiled only into the NVSHMEM module (relocatable device code,
// linked with NVSHMEM's device library: CMakeLists.txt), never into _dfccl_cuda,
// which loads without NVSHMEM.
//
// Mapping of the contract:
//   Put       nvshmem_putmem_signal_nbi(dst, src, bytes, sig, add, NVSHMEM_SIGNAL_ADD, pe):
//             NVSHMEM orders the signal after the bytes (a PE that sees the add sees them).
//   PutWarp   a peer NVSHMEM maps into this GPU (nvshmem_ptr: NVLink, or the same GPU under
//             MPS): the warp's own stores, a system-scope fence, then nvshmemx_signal_op (the
//             copy through L2: the source is XLA's buffer, see WarpCopy); any other peer:
//             the source copied into this rank's own region at stage_off first (symmetric,
//             so NVSHMEM's network can read it, which XLA's buffer is not), then
//             nvshmemx_putmem_signal_nbi_warp from there.
//   PutValue  a system-scope fence (this thread's earlier reads and writes), nvshmem_fence
//             (its earlier puts to the PE), then nvshmem_uint64_p.
//   Signal    an acquire load of the own word (peers' signal operations land there).
//   Poll      a volatile load of it; Acquire a system-scope fence.
//   Flush     nvshmem_quiet, which has no bound of its own: its bound is the host's
//             watchdog (the caller's timeout), as the contract allows for engines.
//   DeadMask  the host's liveness report in local memory (scale-out.md §8).
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "transport/transport.cuh"

namespace dfccl::gpu {

struct NvshmemTransport {
  int rank = 0, nranks = 0;
  char* heap = nullptr;                   // the symmetric allocation (this PE's address of it)
  const uint64_t* dead = nullptr;         // the host's dead-rank mask (local; null: none)
  int pe[kTransportMaxRanks] = {};        // rank -> PE (a communicator is a subset of the PEs)
  uint64_t at[kTransportMaxRanks] = {};   // rank -> its region's offset in `heap`

  DFCCL_DEV int Rank() const { return rank; }
  DFCCL_DEV int Ranks() const { return nranks; }
  DFCCL_DEV char* Local(uint64_t off) { return heap + at[rank] + off; }
  DFCCL_DEV char* At(int r, uint64_t off) const { return heap + at[r] + off; }
  DFCCL_DEV uint64_t DeadMask() const { return dead ? LdVol(dead) : 0ull; }

  DFCCL_DEV bool Put(int peer, uint64_t dst_off, const void* src, uint32_t bytes, uint64_t signal_off, uint64_t add) {
    if (DeadMask() >> peer & 1ull) return false;
    nvshmem_putmem_signal_nbi(At(peer, dst_off), src, bytes, reinterpret_cast<uint64_t*>(At(peer, signal_off)), add,
                              NVSHMEM_SIGNAL_ADD, pe[peer]);
    return true;
  }
  DFCCL_DEV bool PutWarp(int lane, int peer, uint64_t dst_off, const void* src, uint32_t bytes, uint64_t signal_off,
                         uint64_t add, uint64_t stage_off) {
    if (__shfl_sync(0xffffffffu, lane == 0 ? DeadMask() >> peer & 1ull : 0ull, 0)) return false;
    uint64_t* sig = reinterpret_cast<uint64_t*>(At(peer, signal_off));
    if (char* p = static_cast<char*>(nvshmem_ptr(At(peer, dst_off), pe[peer]))) {
      WarpCopy(lane, p, static_cast<const char*>(src), bytes);
      FenceAcqRelSys();
      __syncwarp();
      if (lane == 0) nvshmemx_signal_op(sig, add, NVSHMEM_SIGNAL_ADD, pe[peer]);
      __syncwarp();
    } else {
      char* stage = Local(stage_off);
      WarpCopy(lane, stage, static_cast<const char*>(src), bytes);
      FenceAcqRelSys();  // (the network reads the staged bytes)
      __syncwarp();
      nvshmemx_putmem_signal_nbi_warp(At(peer, dst_off), stage, bytes, sig, add, NVSHMEM_SIGNAL_ADD, pe[peer]);
    }
    return true;
  }
  DFCCL_DEV bool PutValue(int peer, uint64_t off, uint64_t v) {
    if (DeadMask() >> peer & 1ull) return false;
    FenceAcqRelSys();
    nvshmem_fence();
    nvshmem_uint64_p(reinterpret_cast<uint64_t*>(At(peer, off)), v, pe[peer]);
    return true;
  }
  DFCCL_DEV uint64_t Signal(uint64_t off) { return LdAcquireSys(reinterpret_cast<const uint64_t*>(Local(off))); }
  DFCCL_DEV uint64_t Poll(uint64_t off) { return LdVol(reinterpret_cast<const uint64_t*>(Local(off))); }
  DFCCL_DEV void Acquire() { FenceAcqRelSys(); }
  DFCCL_DEV bool Flush(uint64_t) {
    nvshmem_quiet();
    return true;
  }
};

}  // namespace dfccl::gpu
