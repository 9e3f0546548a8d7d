// The direct path (one process, peer access; TaskDesc::direct): no staging and
// no intermediate copies.  A lane reads its peers' inputs and writes their
// outputs in place over NVLink, between two handshakes per lane:
//
//   ready     lane l of rank r, once r's task is ready (r's stream reached the
//             collective: its input is complete and XLA no longer uses its
//             output buffer): thread 0 stores r's (in, out) addresses into the
//             mailbox of every rank p that touches r's buffers (p.mail[slot][r]),
//             fence.sc.sys, then st.release.sys p.credits[1][slot][r][l] = E + 1.
//   wait      lane l polls (ld.acquire.sys) its own credits[1][slot][p][l] >= E + 1
//             for every rank p it touches, then reads p's addresses from its mailbox.
//   move      the op's DirectMove (device/collectives/<op>.cuh) on the lane's chunks: the unit is cut
//             into TaskDesc::lane_bytes pieces (4 KiB .. kDirectChunk, so that every
//             lane has one) dealt round-robin to the lanes (chunk c to
//             lane c % lanes), so at any time every lane works in the same few
//             pages of each buffer (contiguous per-lane ranges spread the NVLink
//             stores over as many pages as lanes and ran at a third of the rate);
//             kDirectStep bytes per scheduling turn (other tasks run between).
//   finished  every thread fence.sc.sys (its remote stores and loads are complete),
//             __syncthreads, thread 0 st.release.sys p.flags[1][slot][r][l] = E + 1 to
//             every rank p it touched; the lane is done once the flags of every rank
//             that touches r's buffers arrived: then no peer reads r's input or
//             writes r's output again, and the task may complete (done on r's stream).
//
// Across processes (CommDev::xmap[p] set): p's mailbox addresses are XAddr
// words; `ready` maps them through p's range table (XLocal) and waits, like for
// a late peer, while p's range is not mapped here yet (runtime/ipc.h), or was
// mapped after the daemon's launch (then the daemon is relaunched: a kernel
// touches no mapping younger than itself).
//
// Lane l of every rank covers the same chunks of the op's unit (DirectUnitBytes;
// the lane plan depends only on values equal across ranks), so waiting for lane
// l's flags on every lane covers every peer access.  Both waits are polls under
// the Spinner budget: a lane whose peers are late is preempted like any other.
#pragma once

#include <type_traits>

#include "device/wait.cuh"

namespace dfccl::gpu {

inline constexpr int64_t kDirectStep = 1 << 20;  // bytes a lane moves per scheduling turn

namespace direct {

constexpr int U = 4;  // 16-byte vectors in flight per thread and source

DFCCL_DEV bool Aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// dst[k][0:len) = R-reduction over src[0..nsrc)[0:len), for k < ndst; by the whole block.
template <class T, class R>
DFCCL_DEV void Reduce(char* const* dst, int ndst, const char* const* src, int nsrc, int64_t len) {
  using A = typename Acc<T>::type;
  constexpr int K = 16 / sizeof(T);
  const R op;
  bool vec = true;
  for (int k = 0; k < ndst; ++k) vec = vec && Aligned(dst[k]);
  for (int s = 0; s < nsrc; ++s) vec = vec && Aligned(src[s]);
  const int64_t n16 = vec ? len / 16 : 0;
  for (int64_t i0 = threadIdx.x; i0 < n16; i0 += U * kThreads) {
    A acc[U][K];
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * kThreads < n16) v[u] = __ldcg(reinterpret_cast<const uint4*>(src[0]) + i0 + u * kThreads);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < K; ++k) acc[u][k] = Begin<R, kDeviceStart>(Acc<T>::Load(reinterpret_cast<const T*>(&v[u])[k]));
    for (int s = 1; s < nsrc; ++s) {
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i0 + u * kThreads < n16) v[u] = __ldcg(reinterpret_cast<const uint4*>(src[s]) + i0 + u * kThreads);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int k = 0; k < K; ++k) acc[u][k] = op(acc[u][k], Acc<T>::Load(reinterpret_cast<const T*>(&v[u])[k]));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0 + u * kThreads >= n16) continue;
#pragma unroll
      for (int k = 0; k < K; ++k) reinterpret_cast<T*>(&v[u])[k] = Acc<T>::Store(acc[u][k]);
      for (int k = 0; k < ndst; ++k) reinterpret_cast<uint4*>(dst[k])[i0 + u * kThreads] = v[u];
    }
  }
  // The rest element by element (a tail, or everything when a buffer is not 16-byte aligned).
  const int64_t e0 = n16 * 16 / static_cast<int64_t>(sizeof(T)), ne = len / static_cast<int64_t>(sizeof(T));
  for (int64_t i = e0 + threadIdx.x; i < ne; i += kThreads) {
    A acc = Begin<R, kDeviceStart>(Acc<T>::Load(__ldcg(reinterpret_cast<const T*>(src[0]) + i)));
    for (int s = 1; s < nsrc; ++s) acc = op(acc, Acc<T>::Load(__ldcg(reinterpret_cast<const T*>(src[s]) + i)));
    const T r = Acc<T>::Store(acc);
    for (int k = 0; k < ndst; ++k) reinterpret_cast<T*>(dst[k])[i] = r;
  }
}

// dst[k][0:len) = src[0:len) for k < ndst (or zeros when src is null); by the whole block.
template <class T>
DFCCL_DEV void Copy(char* const* dst, int ndst, const char* src, int64_t len) {
  bool vec = src == nullptr || Aligned(src);
  for (int k = 0; k < ndst; ++k) vec = vec && Aligned(dst[k]);
  const int64_t n16 = vec ? len / 16 : 0;
  for (int64_t i0 = threadIdx.x; i0 < n16; i0 += U * kThreads) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * kThreads < n16)
        v[u] = src ? __ldcg(reinterpret_cast<const uint4*>(src) + i0 + u * kThreads) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * kThreads < n16)
        for (int k = 0; k < ndst; ++k) reinterpret_cast<uint4*>(dst[k])[i0 + u * kThreads] = v[u];
  }
  using W = std::conditional_t<sizeof(T) == 8, unsigned long long,
                               std::conditional_t<sizeof(T) == 4, unsigned int,
                                                  std::conditional_t<sizeof(T) == 2, unsigned short, unsigned char>>>;
  const int64_t e0 = n16 * 16 / static_cast<int64_t>(sizeof(W)), ne = len / static_cast<int64_t>(sizeof(W));
  for (int64_t i = e0 + threadIdx.x; i < ne; i += kThreads) {
    const W w = src ? __ldcg(reinterpret_cast<const W*>(src) + i) : W{0};
    for (int k = 0; k < ndst; ++k) reinterpret_cast<W*>(dst[k])[i] = w;
  }
}

// Who touches whose buffers: the op's SendsTo / RecvsFrom (every trait in
// device/collectives/ has them), never the rank itself.
template <class Op>
DFCCL_DEV bool Touches(const TaskDesc& d, int p) {  // this rank accesses p's buffers
  return p != d.rank && Op::SendsTo(d, p);
}
template <class Op>
DFCCL_DEV bool TouchedBy(const TaskDesc& d, int p) {  // p accesses this rank's buffers
  return p != d.rank && Op::RecvsFrom(d, p);
}

// The bytes of the unit this rank's lanes split: the op's DirectShare, or the whole unit.
template <class Op>
DFCCL_DEV int64_t Share(const TaskDesc& d, int64_t unit) {
  if constexpr (requires { Op::DirectShare(d, unit); }) return Op::DirectShare(d, unit);
  else return unit;
}

// A mailbox word of rank p as an address of this process: itself when p is in
// this process (no range table), else mapped through p's range table; null
// while that range is not mapped here (or a stale entry still holds its tag),
// and null with *newer set (if given) when it was mapped after this kernel's
// launch (XRange::gen > map_gen): a kernel reads only mappings older than itself
// (what memory checkers assume of a launch), so the daemon must be relaunched.
DFCCL_DEV char* XLocal(const CommDev* cm, int p, uint64_t word, uint64_t map_gen, bool* newer = nullptr) {
  const XRange* table = cm->xmap[p];
  const uint64_t va = word & ((uint64_t{1} << kXTagShift) - 1);
  const int tag = static_cast<int>(word >> kXTagShift);
  if (table == nullptr || tag == 0) return reinterpret_cast<char*>(va);
  // An entry is written once, local_base last, so a field still 0 means "not yet"
  // (runtime/ipc.cc Publish): both halves read at once, no order needed.
  static_assert(sizeof(XRange) == 32 && offsetof(XRange, local_base) == 16, "XRange: two 16-byte halves");
  auto read = [](const XRange* e, uint64_t (&f)[4]) {
    const uint4 h0 = LdVolVec(e), h1 = LdVolVec(reinterpret_cast<const char*>(e) + 16);
    f[0] = (static_cast<uint64_t>(h0.y) << 32) | h0.x;  // remote_base
    f[1] = (static_cast<uint64_t>(h0.w) << 32) | h0.z;  // size
    f[2] = (static_cast<uint64_t>(h1.y) << 32) | h1.x;  // local_base
    f[3] = (static_cast<uint64_t>(h1.w) << 32) | h1.z;  // gen
    return f[1] != 0 && f[2] != 0 && f[3] != 0;
  };
  uint64_t f[4];
  if (!read(table + tag, f)) {  // a miss in this GPU's cache: the published table (host memory), into the cache
    const XRange* shared = reinterpret_cast<const XRange*>(LdVol(&table[0].remote_base));
    if (!read(shared + tag, f)) return nullptr;
    XRange* c = const_cast<XRange*>(table + tag);
    StVolVec(c, make_uint4(static_cast<uint32_t>(f[0]), static_cast<uint32_t>(f[0] >> 32), static_cast<uint32_t>(f[1]),
                           static_cast<uint32_t>(f[1] >> 32)));
    StVolVec(reinterpret_cast<char*>(c) + 16, make_uint4(static_cast<uint32_t>(f[2]), static_cast<uint32_t>(f[2] >> 32),
                                                          static_cast<uint32_t>(f[3]), static_cast<uint32_t>(f[3] >> 32)));
  }
  const uint64_t base = f[0], size = f[1], local = f[2], gen = f[3];
  if (va < base || va - base >= size) return nullptr;
  if (gen > map_gen) {
    if (newer) *newer = true;
    return nullptr;
  }
  return reinterpret_cast<char*>(local + (va - base));
}

}  // namespace direct

// The ranks' buffer addresses of the lane being moved (one copy per block, shared by every op).
struct DirectAddrs {
  const char* in[kMaxRanks];
  char* out[kMaxRanks];
};
__device__ __noinline__ DirectAddrs& BlockAddrs() {
  __shared__ DirectAddrs addrs;
  return addrs;
}

template <class Op, class T, class R>
__device__ int LaneBodyDirect(const TaskDesc& d, LaneState& s, int lane, const DaemonParams& P) {
  DirectAddrs& ad = BlockAddrs();
  const char* const* in = ad.in;
  char* const* out = ad.out;
  const CommDev* cm = d.comm;
  const int n = d.nranks, me = d.rank;
  const int lanes = cm->pool[1].lanes;
  const uint64_t E = static_cast<uint64_t>(d.epoch) << 32;
  const int64_t slot = d.slot;  // in a register (d may be in shared memory, reloaded after every fence)
  const size_t row = static_cast<size_t>(slot) * n;  // the mailboxes' [slot][rank]
  auto cell = [&](int src) { return PoolCell(slot, n, src, lanes, lane); };  // device/task.h
  const int64_t unit = DirectUnitBytes(d.kind, d.msg_bytes, n);
  const int64_t share = direct::Share<Op>(d, unit);
  const int64_t chunk = d.lane_bytes;  // direct: the chunk size (host: 4 KiB .. kDirectChunk)
  const int64_t nchunks = (share + chunk - 1) / chunk;
  const int64_t my_chunks = nchunks > lane ? (nchunks - lane + d.lanes - 1) / d.lanes : 0;  // chunks lane, lane + lanes, ...
  // Every rank p with sel(p) has stored E + 1 into its word of `words` (this rank's copy).
  auto arrived = [&](const uint64_t* words, auto sel) {
    return BlockPoll([&] {
      for (int p = 0; p < n; ++p)
        if (sel(p) && LdAcquireSys(words + cell(p)) < E + 1) return false;
      return true;
    });
  };
  auto touches = [&](int p) { return direct::Touches<Op>(d, p); };
  auto touched_by = [&](int p) { return direct::TouchedBy<Op>(d, p); };
  // Every rank I touch in another process: its buffers' ranges are mapped here,
  // before this daemon's launch.  Its tagged mailbox words are then replaced by
  // the local addresses, so the steps mostly skip the range table; p's other
  // lanes may still store the tagged words again (the same values), which
  // XLocal maps as well.  A range mapped after the launch: this daemon leaves
  // (DeviceShared::stale_map, seen by the control warp) and the proxy launches
  // the next one, which may read it; the lane waits, preemptible, meanwhile.
  auto mapped = [&] {
    bool newer = false;
    for (int p = 0; p < n; ++p) {
      if (!touches(p) || cm->xmap[p] == nullptr) continue;
      volatile uint64_t* m = cm->mail[me] + 2 * row + 2 * p;
      for (int k = 0; k < 2; ++k) {
        const uint64_t w = m[k];
        if ((w >> kXTagShift) == 0) continue;
        char* local = direct::XLocal(cm, p, w, P.map_gen, &newer);
        if (local == nullptr) {
          if (newer) StVol(&P.dev->stale_map, P.launch_id);
          return false;
        }
        m[k] = reinterpret_cast<uint64_t>(local);
      }
    }
    return true;
  };
  int result = 0;
  Spinner spin(P.spin_ns << min(s.sticky, P.sticky_max));
  while (true) {
    if (s.c_send == 0) {  // ready: my addresses, then my credit, to every rank that touches my buffers
      if (threadIdx.x == 0) {
        for (int p = 0; p < n; ++p) {
          if (!touched_by(p)) continue;
          volatile uint64_t* m = cm->mail[p] + 2 * row + 2 * me;
          m[0] = XAddr(d.in, XTagIn(d.direct));
          m[1] = XAddr(d.out, XTagOut(d.direct));
        }
        __threadfence_system();
        for (int p = 0; p < n; ++p)
          if (touched_by(p)) StReleaseSys(cm->credits[1][p] + cell(me), E + 1);
      }
      s.c_send = 1;
      result = kMoved;
    } else if (s.c_send == 1) {  // wait until every rank I touch is ready (and its buffers are mapped here)
      if (!arrived(cm->credits[1][me], touches) || !BlockPoll([&] { return mapped(); })) {
        if (!spin.KeepSpinning()) { s.sticky >>= 1; return result | kPreempted; }
        continue;
      }
      s.c_send = 2;
      s.sticky = min(s.sticky + 1, P.sticky_max);
      result = kMoved;
    } else if (s.c_send == 2) {  // move one step, then let other tasks run
      if (threadIdx.x == 0) {
        // (`mapped` saw every range this lane reads mapped before the launch.)
        for (int p = 0; p < n; ++p) {
          const volatile uint64_t* m = cm->mail[me] + 2 * row + 2 * p;
          ad.in[p] = p == me ? d.in : touches(p) ? direct::XLocal(cm, p, m[0], P.map_gen) : nullptr;
          ad.out[p] = p == me ? d.out : touches(p) ? direct::XLocal(cm, p, m[1], P.map_gen) : nullptr;
        }
      }
      __syncthreads();
      const int64_t k_step = s.c_recv + (kDirectStep + chunk - 1) / chunk;
      const int64_t k_end = my_chunks < k_step ? my_chunks : k_step;
      for (int64_t k = s.c_recv; k < k_end; ++k) {
        const int64_t a = (lane + k * d.lanes) * chunk;
        Op::template DirectMove<T, R>(d, in, out, unit, a, min(chunk, share - a));
      }
      __syncthreads();  // every thread is done with in/out before thread 0 may rewrite them
      s.c_recv = static_cast<int32_t>(k_end);
      if (k_end >= my_chunks) s.c_send = 3;
      return result | kMoved;
    } else if (s.c_send == 3) {  // finished: my accesses to every rank I touched are complete
      __threadfence_system();
      __syncthreads();
      if (threadIdx.x == 0)
        for (int p = 0; p < n; ++p)
          if (touches(p)) StReleaseSys(cm->flags[1][p] + cell(me), E + 1);
      s.c_send = 4;
      result = kMoved;
    } else {  // wait until every rank that touches my buffers has finished
      if (!arrived(cm->flags[1][me], touched_by)) {
        if (!spin.KeepSpinning()) { s.sticky >>= 1; return result | kPreempted; }
        continue;
      }
      return kDone | kMoved;
    }
    spin.Progress();
  }
}

}  // namespace dfccl::gpu
