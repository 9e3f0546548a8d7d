// The lane state machine shared by every collective (the "step").  A task's
// per-peer message (TaskDesc::msg_bytes) is split into lanes (one block's
// share each); a lane moves its range in chunks through the instance slot's
// staging ring on each receiver:
//
//   send   chunk c to peer p: (c >= depth: wait credit >= c-depth+1 from p)
//          store into p's staging[slot][me][lane][c % depth]; every thread
//          fence.sc.sys (a barrier does not make other warps' remote stores
//          visible system-wide), __syncthreads, then thread 0 stores the flag
//          p.flags[slot][me][lane] = E + c + 1  (E = epoch << 32)
//   recv   chunk c: wait every source's flag >= E + c + 1 on my device, combine
//          (Op::Combine: reduce or place the sources into the output), then
//          credit each source: src.credits[slot][me][lane] = E + c + 1
//
// Every wait is a poll under a Spinner budget: when neither sending nor
// receiving can move and the budget is spent, the lane returns kPreempted with
// its (c_send, p_send, c_recv) saved in LaneState, and resumes from there.
// Ops supply: SendsTo(d, p), SendOffset(d, p) (into the input), RecvsFrom(d, r),
// SelfOffset(d) (own input as a source) and Combine<T, R>(d, src, off, len).
#pragma once

#include "device/direct.cuh"

namespace dfccl::gpu {

template <class Op, class T, class R>
__device__ int LaneBody(const TaskDesc& d, LaneState& s, int lane, const DaemonParams& P) {
  const CommDev* cm = d.comm;
  const int pool = d.pool;
  const PoolGeom g = cm->pool[pool];
  const int n = d.nranks, me = d.rank;
  const int64_t C = g.chunk_bytes;
  const int64_t lane_off = lane * d.lane_bytes;
  const int64_t lane_len = max(int64_t{0}, min(d.lane_bytes, d.msg_bytes - lane_off));
  const int nchunks = lane_len == 0 ? 1 : static_cast<int>((lane_len + C - 1) / C);
  const uint64_t E = static_cast<uint64_t>(d.epoch) << 32;
  const size_t slot_base = static_cast<size_t>(d.slot) * n;
  uint64_t* my_flags = cm->flags[pool][me];
  char* my_stage = cm->stage[pool][me];
  int result = 0;
  Spinner spin(P.spin_ns << min(s.sticky, P.sticky_max));

  while (s.c_recv < nchunks || s.c_send < nchunks) {  // done when all is received AND sent
    bool moved = false, peer_moved = false;
    // Send every chunk the credits allow.
    while (s.c_send < nchunks) {
      int p = s.p_send;
      while (p < n && (p == me || !Op::SendsTo(d, p))) ++p;
      if (p == n) { s.c_send++; s.p_send = 0; continue; }
      const int c = s.c_send;
      if (c >= g.depth) {
        const uint64_t* cr = cm->credits[pool][me] + (slot_base + p) * g.lanes + lane;
        if (!BlockPoll([&] { return LdAcquireSys(cr) >= E + static_cast<uint64_t>(c - g.depth + 1); })) break;
      }
      const int64_t off = lane_off + c * C;
      const int64_t len = min(C, lane_len - c * C);
      char* dst = cm->stage[pool][p] + (((slot_base + me) * g.lanes + lane) * g.depth + c % g.depth) * C;
      BlockCopy(dst, d.in + Op::SendOffset(d, p) + off, len, d.vec, d.elem_bytes);
      __threadfence_system();  // every thread: its remote stores complete before the flag
      __syncthreads();
      if (threadIdx.x == 0) {
        StReleaseSys(cm->flags[pool][p] + (slot_base + me) * g.lanes + lane, E + c + 1);
      }
      s.p_send = p + 1;
      moved = true;
    }
    // Receive the next chunk once every source has delivered it.
    if (s.c_recv < nchunks) {
      const int c = s.c_recv;
      const bool ok = BlockPoll([&] {
        for (int r = 0; r < n; ++r)
          if (r != me && Op::RecvsFrom(d, r) &&
              LdAcquireSys(my_flags + (slot_base + r) * g.lanes + lane) < E + c + 1)
            return false;
        return true;
      });
      if (ok) {
        const int64_t off = lane_off + c * C;
        const int64_t len = min(C, lane_len - c * C);
        const char* src[kMaxRanks];
        for (int r = 0; r < n; ++r)
          src[r] = r == me ? d.in + Op::SelfOffset(d) + off
                           : my_stage + (((slot_base + r) * g.lanes + lane) * g.depth + c % g.depth) * C;
        Op::template Combine<T, R>(d, src, off, len);
        __syncthreads();
        if (threadIdx.x == 0 && nchunks > g.depth) {
          for (int r = 0; r < n; ++r)
            if (r != me && Op::RecvsFrom(d, r))
              StReleaseSys(cm->credits[pool][r] + (slot_base + me) * g.lanes + lane, E + c + 1);
        }
        s.c_recv++;
        moved = peer_moved = true;
      }
    }
    if (moved) {
      result = kMoved;
      spin.Progress();
      if (peer_moved) s.sticky = min(s.sticky + 1, P.sticky_max);
    } else if (!spin.KeepSpinning()) {
      s.sticky >>= 1;
      return result | kPreempted;
    }
  }
  return result | kDone;
}

// Reduce ops combine 8-byte units of every rank (LL path).
template <class T, class R>
DFCCL_DEV uint2 ReduceUnit(const uint2* v, int n) {
  using A = typename Acc<T>::type;
  constexpr int K = 8 / sizeof(T);
  const R op;
  A acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = Begin<R, kDeviceStart>(Acc<T>::Load(reinterpret_cast<const T*>(&v[0])[k]));
  for (int r = 1; r < n; ++r)
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] = op(acc[k], Acc<T>::Load(reinterpret_cast<const T*>(&v[r])[k]));
  uint2 out;
#pragma unroll
  for (int k = 0; k < K; ++k) reinterpret_cast<T*>(&out)[k] = Acc<T>::Store(acc[k]);
  return out;
}

// The small-message path (pool 0, one chunk per lane): the LL protocol.  Each
// 16-byte line {d0, F, d1, F} carries 8 data bytes and the flag F = epoch twice,
// so every 8-byte half validates itself: no fence, no separate flag, and no
// ordering between data and flag to get wrong.  The sender pushes its lines;
// the receiver polls its lines until every flag matches, then combines.
template <class Op, class T, class R>
__device__ int LaneBodyLL(const TaskDesc& d, LaneState& s, int lane, const DaemonParams& P) {
  const CommDev* cm = d.comm;
  const int lanes = cm->pool[0].lanes;
  const int64_t C = cm->pool[0].chunk_bytes;
  const int n = d.nranks, me = d.rank;
  const int64_t lane_off = lane * d.lane_bytes;
  const int64_t len = max(int64_t{0}, min(d.lane_bytes, d.msg_bytes - lane_off));
  const int nu = static_cast<int>(len / 8);
  const uint32_t F = d.epoch;
  const size_t slot_base = static_cast<size_t>(d.slot) * n;
  auto lines = [&](int at, int src) {
    return reinterpret_cast<uint4*>(cm->stage[0][at] + ((slot_base + src) * lanes + lane) * C);
  };
  int result = 0;
  if (s.c_send == 0) {
    for (int p = 0; p < n; ++p) {
      if (p == me || !Op::SendsTo(d, p)) continue;
      const uint2* src = reinterpret_cast<const uint2*>(d.in + Op::SendOffset(d, p) + lane_off);
      uint4* dst = lines(p, me);
      for (int u = threadIdx.x; u < nu; u += kThreads) {
        const uint2 v = __ldcg(src + u);
        StVolVec(dst + u, make_uint4(v.x, F, v.y, F));
      }
    }
    s.c_send = 1;
    result = kMoved;
  }
  if (P.stamps && threadIdx.x == 0) P.stamps[kEvLaneReady - kEvLaneEntered] = GlobalTimer();
  Spinner spin(P.spin_ns << min(s.sticky, P.sticky_max));
  while (true) {
    bool ok = true;
    for (int r = 0; r < n && ok; ++r) {
      if (r == me || !Op::RecvsFrom(d, r)) continue;
      const uint4* L = lines(me, r);
      for (int u = threadIdx.x; u < nu; u += kThreads) {
        const uint4 v = LdVolVec(L + u);
        if (v.y != F || v.w != F) { ok = false; break; }
      }
    }
    if (__syncthreads_and(ok)) break;
    if (!spin.KeepSpinning()) { s.sticky >>= 1; return result | kPreempted; }
  }
  if (P.stamps && threadIdx.x == 0) P.stamps[kEvLanePolled - kEvLaneEntered] = GlobalTimer();
  for (int u = threadIdx.x; u < nu; u += kThreads) {
    uint2 v[kMaxRanks];
    for (int r = 0; r < n; ++r) {
      if (r == me) {
        v[r] = __ldcg(reinterpret_cast<const uint2*>(d.in + Op::SelfOffset(d) + lane_off) + u);
      } else if (Op::RecvsFrom(d, r)) {
        const uint4 l = LdVolVec(lines(me, r) + u);
        v[r] = make_uint2(l.x, l.z);
      } else {
        v[r] = make_uint2(0, 0);
      }
    }
    Op::template CombineUnit<T, R>(d, v, lane_off + 8 * static_cast<int64_t>(u));
  }
  if (P.stamps && threadIdx.x == 0) P.stamps[kEvLaneCombined - kEvLaneEntered] = GlobalTimer();
  s.c_recv = 1;
  s.sticky = min(s.sticky + 1, P.sticky_max);
  return kDone | kMoved;
}

// Every thread works on a register copy of the lane state (block-uniform);
// thread 0 writes it back.  kLLOnly: the lane is known to be a pool-0 one (the
// inline submit kernel, which instantiates it per (Op, T, R) and inlines it).
template <class Op, class T, class R, bool kLLOnly>
__device__ __forceinline__ int RunLaneBody(const TaskDesc& d, LaneState& shared_state, int lane,
                                           const DaemonParams& P) {
  if (P.stamps && threadIdx.x == 0) P.stamps[kEvLaneEntered - kEvLaneEntered] = GlobalTimer();
  LaneState s = shared_state;
  int r;
  if constexpr (kLLOnly) r = LaneBodyLL<Op, T, R>(d, s, lane, P);
  else r = d.direct ? LaneBodyDirect<Op, T, R>(d, s, lane, P)
           : d.pool == 0 ? LaneBodyLL<Op, T, R>(d, s, lane, P)
                         : LaneBody<Op, T, R>(d, s, lane, P);
  if (r & kDone) __threadfence();  // every thread's output stores, before the task can complete
  __syncthreads();
  if (P.stamps && threadIdx.x == 0 && (r & kDone)) P.stamps[kEvLaneFenced - kEvLaneEntered] = GlobalTimer();
  if (threadIdx.x == 0) shared_state = s;
  __syncthreads();
  return r;
}

// The daemon's lane step (reached through a function pointer: one call site).
template <class Op, class T, class R>
__device__ __noinline__ int RunLane(const TaskDesc& d, LaneState& shared_state, int lane, const DaemonParams& P) {
  return RunLaneBody<Op, T, R, false>(d, shared_state, lane, P);
}

// Building blocks of the collective traits (collectives/<op>.cuh): who sends
// which part of its input to whom, and how a rank combines its sources.

// Every rank sends its whole input to every peer.
struct SendWholeToAll {
  static DFCCL_DEV bool SendsTo(const TaskDesc&, int) { return true; }
  static DFCCL_DEV int64_t SendOffset(const TaskDesc&, int) { return 0; }
  static DFCCL_DEV bool RecvsFrom(const TaskDesc&, int) { return true; }
  static DFCCL_DEV int64_t SelfOffset(const TaskDesc&) { return 0; }
};

// Every rank sends block p of its input to rank p (and keeps its own block).
struct SendBlockToEach {
  static DFCCL_DEV bool SendsTo(const TaskDesc&, int) { return true; }
  static DFCCL_DEV int64_t SendOffset(const TaskDesc& d, int p) { return p * d.msg_bytes; }
  static DFCCL_DEV bool RecvsFrom(const TaskDesc&, int) { return true; }
  static DFCCL_DEV int64_t SelfOffset(const TaskDesc& d) { return d.rank * d.msg_bytes; }
};

// out = reduce over all ranks' sources.
struct ReduceSources {
  template <class T, class R>
  static DFCCL_DEV void Combine(const TaskDesc& d, const char* const* src, int64_t off, int64_t len) {
    BlockReduce<T, R>(d.out + off, src, d.nranks, len, d.vec);
  }
  template <class T, class R>
  static DFCCL_DEV void CombineUnit(const TaskDesc& d, const uint2* v, int64_t off) {
    *reinterpret_cast<uint2*>(d.out + off) = ReduceUnit<T, R>(v, d.nranks);
  }
};

// out[r] = source of rank r.
struct PlaceSources {
  template <class T, class R>
  static DFCCL_DEV void Combine(const TaskDesc& d, const char* const* src, int64_t off, int64_t len) {
    for (int r = 0; r < d.nranks; ++r) BlockCopy(d.out + r * d.msg_bytes + off, src[r], len, d.vec, d.elem_bytes);
  }
  template <class T, class R>
  static DFCCL_DEV void CombineUnit(const TaskDesc& d, const uint2* v, int64_t off) {
    for (int r = 0; r < d.nranks; ++r) *reinterpret_cast<uint2*>(d.out + r * d.msg_bytes + off) = v[r];
  }
};

}  // namespace dfccl::gpu
