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
  const int64_t slot = d.slot;  // in a register (d may be in shared memory, reloaded after every fence)
  auto cell = [&](int rank) { return PoolCell(slot, n, rank, g.lanes, lane); };  // device/task.h
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
        const uint64_t* cr = cm->credits[pool][me] + cell(p);
        if (!BlockPoll([&] { return LdAcquireSys(cr) >= E + static_cast<uint64_t>(c - g.depth + 1); })) break;
      }
      const int64_t off = lane_off + c * C;
      const int64_t len = min(C, lane_len - c * C);
      char* dst = cm->stage[pool][p] + (cell(me) * g.depth + c % g.depth) * C;
      BlockCopy(dst, d.in + Op::SendOffset(d, p) + off, len, d.vec, d.elem_bytes);
      __threadfence_system();  // every thread: its remote stores complete before the flag
      __syncthreads();
      if (threadIdx.x == 0) {
        StReleaseSys(cm->flags[pool][p] + cell(me), E + c + 1);
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
              LdAcquireSys(my_flags + cell(r)) < E + c + 1)
            return false;
        return true;
      });
      if (ok) {
        const int64_t off = lane_off + c * C;
        const int64_t len = min(C, lane_len - c * C);
        const char* src[kMaxRanks];
        for (int r = 0; r < n; ++r)
          src[r] = r == me ? d.in + Op::SelfOffset(d) + off
                           : my_stage + (cell(r) * g.depth + c % g.depth) * C;
        Op::template Combine<T, R>(d, src, off, len);
        __syncthreads();
        if (threadIdx.x == 0 && nchunks > g.depth) {
          for (int r = 0; r < n; ++r)
            if (r != me && Op::RecvsFrom(d, r))
              StReleaseSys(cm->credits[pool][r] + cell(me), E + c + 1);
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
// Matched by identity (device/task.h, "identity"; F = IdentityTag): a sender
// writes a receiver's cell once its previous message there was consumed, with a
// header carrying the signature; the receiver checks the headers, combines,
// and tells each sender it consumed them.  Sends and the
// receive are separate steps (LaneState::p_send: the next peer), so a lane
// whose cell at one peer is still occupied receives meanwhile.
// `pre` (identity, may be null): the words of the lane's cells in this rank's
// credits, read by the caller already (AckPreRead; [p * kIdentityWays + way]),
// used for the first claim at each peer instead of reading them again.  Words read
// earlier are an earlier view: a way seen busy is skipped, a stale free one fails
// its CAS; either is retried on the next pass with words read then.
template <class Op, class T, class R>
__device__ int LaneBodyLL(const TaskDesc& d, LaneState& s, int lane, const DaemonParams& P,
                          const uint64_t* pre = nullptr) {
  const CommDev* cm = d.comm;
  const int lanes = cm->pool[0].lanes;
  const int64_t C = cm->pool[0].chunk_bytes;
  const int n = d.nranks, me = d.rank;
  const int64_t lane_off = lane * d.lane_bytes;
  const int64_t len = max(int64_t{0}, min(d.lane_bytes, d.msg_bytes - lane_off));
  const int nu = static_cast<int>(len / 8);
  const uint32_t F = d.epoch;
  const bool ident = d.match == kMatchIdentity;
  const int ways = ident ? IdentityWays(cm->pool[0].nslots) : 1;  // identity: d.slot is the bucket's first slot
  // A tombstone (protocol "run" in device/task.h) sends a header that names it and no lines,
  // consumes what its peers sent, and never reads its input or writes an output.
  const uint64_t header = (static_cast<uint64_t>(F) << 32) | (d.tomb ? kSigLeftBehind : static_cast<uint32_t>(d.sig_hash));
  auto cell = [&](int w, int src) { return PoolCell(d.slot + w, n, src, lanes, lane); };
  auto lines = [&](int at, int w, int src) { return reinterpret_cast<uint4*>(cm->stage[0][at] + cell(w, src) * C); };
  // Identity: in the sender's credits, [0] the tag its receiver consumed last, [1] the tag it sent last
  // (the low and the high half of the cell's 64-bit word).
  auto ack = [&](int sender, int receiver, int w) { return reinterpret_cast<uint32_t*>(cm->credits[0][sender] + cell(w, receiver)); };
  // One unit per thread (nu <= kThreads, e.g. 4 KiB): the receive keeps the lines it polled and combines
  // them from registers (no second load); the own input is loaded before the polls.
  const bool one = nu <= kThreads;
  __shared__ int way[kMaxRanks];  // identity: the way each source's message is in (-1: not seen yet)
  __shared__ int pick;
  __shared__ uint32_t fail;
  int result = 0;
  Spinner spin(P.spin_ns << min(s.sticky, P.sticky_max));
  while (true) {
    bool moved = false;
    while (!s.c_send) {  // send to every peer, in rank order
      int p = s.p_send;
      while (p < n && (p == me || !Op::SendsTo(d, p))) ++p;
      if (p == n) { s.c_send = 1; break; }
      const int nu_send = d.tomb ? 0 : nu;
      const uint2* src = reinterpret_cast<const uint2*>(d.in + (d.tomb ? 0 : Op::SendOffset(d, p) + lane_off));
      const uint2 v0 = threadIdx.x < nu_send ? __ldcg(src + threadIdx.x) : make_uint2(0, 0);  // in flight during the claim
      int w = 0;
      if (ident) {
        // Claim a free cell of the bucket at p: one whose last message p consumed, and
        // whose last tag is not F (its lines are not zeroed: they must not pass for F's).
        // Warp 0 reads every way's two words at once; lane 0 claims the first free one
        // with an acquire CAS of the whole word (it keeps [0]: the receiver never writes
        // [0] while the two are equal), which orders the header and the lines after the
        // receiver's consumption of the cell's last message.
        if (threadIdx.x < 32) {
          const int i = threadIdx.x;
          uint64_t words = 0;
          if (i < ways) words = pre ? pre[p * kIdentityWays + i] : LdVol(reinterpret_cast<const uint64_t*>(ack(me, p, i)));
          const uint32_t consumed = static_cast<uint32_t>(words), sent = static_cast<uint32_t>(words >> 32);
          unsigned free = __ballot_sync(0xffffffffu, i < ways && sent != F && consumed == sent);
          int got = -1;
          while (free != 0 && got < 0) {  // warp-uniform
            const int w = __ffs(free) - 1;
            free &= free - 1;
            const uint64_t old = __shfl_sync(0xffffffffu, words, w);
            if (i == 0) {
              uint64_t* a = reinterpret_cast<uint64_t*>(ack(me, p, w));
              const uint64_t claimed = (static_cast<uint64_t>(F) << 32) | static_cast<uint32_t>(old);
              if (CasAcquireSys(a, old, claimed) == old) got = w;
            }
            got = __shfl_sync(0xffffffffu, got, 0);
          }
          if (i == 0) {
            pick = got;
            if (got >= 0) StVol(cm->flags[0][p] + cell(got, me), header);
          }
        }
        __syncthreads();
        w = pick;
        __syncthreads();
        if (w < 0) break;  // every way holds a message p has not consumed yet
      }
      uint4* dst = lines(p, w, me);
      if (threadIdx.x < nu_send) StVolVec(dst + threadIdx.x, make_uint4(v0.x, F, v0.y, F));
      for (int u = threadIdx.x + kThreads; u < nu_send; u += kThreads) {
        const uint2 v = __ldcg(src + u);
        StVolVec(dst + u, make_uint4(v.x, F, v.y, F));
      }
      s.p_send = p + 1;
      moved = true;
    }
    if (P.stamps && threadIdx.x == 0 && moved) P.stamps[kEvLaneReady - kEvLaneEntered] = GlobalTimer();
    if (!s.c_recv) {
      uint2 v[kMaxRanks];  // one: this thread's unit of every source
      if (one && threadIdx.x < nu && !d.tomb)
        v[me] = __ldcg(reinterpret_cast<const uint2*>(d.in + Op::SelfOffset(d) + lane_off) + threadIdx.x);
      // Identity: every source's header first (its way; a mismatch shows before its lines).
      if (threadIdx.x < kMaxRanks) way[threadIdx.x] = ident ? -1 : 0;
      if (threadIdx.x == 0) fail = 0;
      __syncthreads();
      if (ident && threadIdx.x < ways * n) {
        const int r = threadIdx.x / ways, i = threadIdx.x % ways;
        if (r != me && Op::RecvsFrom(d, r)) {
          const uint64_t h = LdVol(cm->flags[0][me] + cell(i, r));
          if (static_cast<uint32_t>(h >> 32) == F) {
            way[r] = i;
            const uint32_t sig = static_cast<uint32_t>(h);
            if (sig == kSigFailed) atomicMax(&fail, PackStatus(kStatusFailedPeer, r, r));  // its sender failed it
            else if (sig == kSigLeftBehind) atomicMax(&fail, PackStatus(kStatusLeftBehind, r, r));  // a tombstone
            else if (sig != static_cast<uint32_t>(d.sig_hash)) atomicMax(&fail, PackStatus(kStatusMismatch, me, r));
          }
        }
      }
      __syncthreads();
      bool heads = true;
      for (int r = 0; ident && r < n; ++r)
        if (r != me && Op::RecvsFrom(d, r) && way[r] < 0) heads = false;
      bool ok = heads || fail != 0;
      for (int r = 0; r < n && ok && !fail; ++r) {
        if (r == me || !Op::RecvsFrom(d, r)) continue;
        const uint4* L = lines(me, way[r], r);
        for (int u = threadIdx.x; u < nu; u += kThreads) {
          const uint4 l = LdVolVec(L + u);
          if (l.y != F || l.w != F) { ok = false; break; }
          if (one) v[r] = make_uint2(l.x, l.z);
        }
      }
      if (__syncthreads_and(ok)) {
        if (P.stamps && threadIdx.x == 0) P.stamps[kEvLanePolled - kEvLaneEntered] = GlobalTimer();
        if (d.tomb) {  // consumed below, never combined
        } else if (!fail && one) {
          if (threadIdx.x < nu) {
            for (int r = 0; r < n; ++r)
              if (r != me && !Op::RecvsFrom(d, r)) v[r] = make_uint2(0, 0);
            Op::template CombineUnit<T, R>(d, v, lane_off + 8 * static_cast<int64_t>(threadIdx.x));
          }
          if (P.stamps && threadIdx.x == 0) P.stamps[kEvLaneCombined - kEvLaneEntered] = GlobalTimer();
        } else if (!fail) {
          for (int u = threadIdx.x; u < nu; u += kThreads) {
            for (int r = 0; r < n; ++r) {
              if (r == me) {
                v[r] = __ldcg(reinterpret_cast<const uint2*>(d.in + Op::SelfOffset(d) + lane_off) + u);
              } else if (Op::RecvsFrom(d, r)) {
                const uint4 l = LdVolVec(lines(me, way[r], r) + u);
                v[r] = make_uint2(l.x, l.z);
              } else {
                v[r] = make_uint2(0, 0);
              }
            }
            Op::template CombineUnit<T, R>(d, v, lane_off + 8 * static_cast<int64_t>(u));
          }
          if (P.stamps && threadIdx.x == 0) P.stamps[kEvLaneCombined - kEvLaneEntered] = GlobalTimer();
        }
        if (ident && n > 1) {
          // Consumed (a mismatched message too, so its sender can go on): every thread has
          // read its lines and used the values (the barrier), so tell the senders, with no
          // fence (as LL receivers return credit): a load whose value is used cannot see a
          // store the sender makes after it learns of the ack.  Header and lines stay: the
          // cell's next message has another tag (the sender's claim).
          __syncthreads();
          if (threadIdx.x == 0) {
            for (int r = 0; r < n; ++r)
              if (r != me && Op::RecvsFrom(d, r) && way[r] >= 0) StVol(ack(r, me, way[r]), F);
          }
        }
        s.c_recv = 1;
        s.fail = fail;
        moved = true;
        s.sticky = min(s.sticky + 1, P.sticky_max);
      }
      __syncthreads();  // shared words above are read by every thread before the next pass rewrites them
    }
    if (s.fail) return kDone | kMoved | kFailed;
    if (s.c_send && s.c_recv) return kDone | kMoved;
    if (moved) {
      result = kMoved;
      spin.Progress();
    } else if (!spin.KeepSpinning()) {
      s.sticky >>= 1;
      return result | kPreempted;
    }
  }
}

// Threads [first, first + n * kIdentityWays), identity: the words of lane 0's
// cells at every peer in this rank's credits (LaneBodyLL's `pre`; the task's
// static part suffices: its bucket is the call site's), so that the inline
// kernel reads them while its thread 0 reads the execution book's line.
DFCCL_DEV void AckPreRead(const TaskDesc& t, int first, uint64_t* pre) {
  const int i = static_cast<int>(threadIdx.x) - first;
  if (i < 0 || i >= t.nranks * kIdentityWays) return;
  const CommDev* cm = t.comm;
  const int p = i / kIdentityWays, w = i % kIdentityWays;
  if (p == t.rank || w >= IdentityWays(cm->pool[0].nslots)) return;
  pre[i] = LdVol(cm->credits[0][t.rank] + PoolCell(t.slot + w, t.nranks, p, cm->pool[0].lanes, 0));
}

// One thread, protocol "identity": task d failed on this rank (not by a
// mismatch): every header it wrote at a peer gets signature bits 0, so the
// peer's lanes fail it too (a consumed header changes too, harmlessly: that
// peer has its message and completed).  A CAS of the exact header: once
// consumed, the cell may hold another task's message of this GPU meanwhile.
// Rare: remote reads of every way of the bucket.
DFCCL_DEV void MarkIdentityFailed(const TaskDesc& d) {
  const CommDev* cm = d.comm;
  const int n = d.nranks, ways = IdentityWays(cm->pool[0].nslots), lanes = cm->pool[0].lanes;
  for (int p = 0; p < n; ++p)
    for (int w = 0; p != d.rank && w < ways; ++w)
      for (int l = 0; l < d.lanes; ++l) {
        uint64_t* h = cm->flags[0][p] + PoolCell(d.slot + w, n, d.rank, lanes, l);
        const uint64_t seen = LdVol(h);
        if (static_cast<uint32_t>(seen >> 32) == d.epoch)
          atomicCAS_system(reinterpret_cast<unsigned long long*>(h), seen, static_cast<uint64_t>(d.epoch) << 32);
      }
  __threadfence_system();
}

// Every thread works on a register copy of the lane state (block-uniform);
// thread 0 writes it back.  kLLOnly: the lane is known to be a pool-0 one (the
// inline submit kernel, which instantiates it per (Op, T, R), inlines it and
// fences the output itself where it must).
template <class Op, class T, class R, bool kLLOnly>
__device__ __forceinline__ int RunLaneBody(const TaskDesc& d, LaneState& shared_state, int lane,
                                           const DaemonParams& P, const uint64_t* pre = nullptr) {
  if (P.stamps && threadIdx.x == 0) P.stamps[kEvLaneEntered - kEvLaneEntered] = GlobalTimer();
  LaneState s = shared_state;
  int r;
  if constexpr (kLLOnly) r = LaneBodyLL<Op, T, R>(d, s, lane, P, pre);
  else r = d.direct ? LaneBodyDirect<Op, T, R>(d, s, lane, P)
           : d.pool == 0 ? LaneBodyLL<Op, T, R>(d, s, lane, P)
                         : LaneBody<Op, T, R>(d, s, lane, P);
  // Every thread's output stores, before the task can complete (the inline kernel
  // fences them itself, and only where another agent learns of the completion).
  if (!kLLOnly && (r & kDone)) __threadfence();
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
