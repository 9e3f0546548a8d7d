// The persistent daemon kernel: `workers` worker blocks run collective lanes,
// one control block (warp 0) ingests the submit kernels' tasks, matches them to
// their instances (device/match.cuh), retires completed tickets, applies aborts
// and decides to quit.
//
// Scheduling: worker block b owns lane l of the task with ticket t when
// (t + l) % workers == b (FirstLane), so independent tasks of few lanes (every
// small message has one) run on different blocks side by side: a block spinning
// on one whose peers have not arrived holds up no other.
// Each pass scans the window [lo, submitted) in parallel, collects tasks that
// are not done, and gives each of its lanes one step
// (RunLane) under a spin budget; a lane that cannot move is preempted and the
// block goes on to the next task.  The last lane to finish completes the task.
#include <atomic>
#include <cstdio>

#include "device/collectives/all_gather.cuh"
#include "device/collectives/all_reduce.cuh"
#include "device/collectives/all_to_all.cuh"
#include "device/collectives/broadcast.cuh"
#include "device/collectives/ppermute.cuh"
#include "device/collectives/ragged_all_to_all.cuh"
#include "device/collectives/reduce_scatter.cuh"
#include "device/announce_path.cuh"
#include "device/daemon.h"
#include "device/match.cuh"
#include "device/submit.cuh"
#include "dfccl/dtype.h"

namespace dfccl::gpu {
namespace {

constexpr int kMaxCand = 64;

// The first lane of ticket t that worker block b owns (lanes b - t, + workers, ...).
__device__ __forceinline__ int FirstLane(uint64_t t, int b, int workers) {
  const int r = static_cast<int>(t % static_cast<uint64_t>(workers));
  return b >= r ? b - r : b - r + workers;
}

// The one dispatch of a task's (op kind, element type, reduce op) to the types
// of its lane code, generated from the op table (dfccl/ops.h): f.template
// operator()<Op, T, R>() (R = SumOp, unused, for ops that do not reduce), or
// Ret{} for an unknown kind.  Host (the inline kernel of a call site) and device
// (the daemon's step).
template <class Ret, class F>
DFCCL_HD Ret ForLaneTypes(int32_t kind, int32_t dtype, int32_t reduce, F&& f) {
  return DispatchDType<CudaTypes>(static_cast<DType>(dtype), [&]<class T>() -> Ret {
    auto reduced = [&]<class Op>() -> Ret {
      return DispatchReduce(static_cast<ReduceOp>(reduce), [&]<class R>() -> Ret { return f.template operator()<Op, T, R>(); });
    };
    switch (static_cast<OpKind>(kind)) {
#define DFCCL_X(E, name, id, reduces, rule, Trait)                  \
  case OpKind::E:                                                  \
    if constexpr (reduces) return reduced.template operator()<Trait>(); \
    else return f.template operator()<Trait, T, SumOp>();
      DFCCL_OP_TABLE(DFCCL_X)
#undef DFCCL_X
    }
    return Ret{};
  });
}

// The daemon selects the lane function and calls it from one call site (a call
// site per instantiation would each reserve its own stack: kilobytes of local
// memory per thread).
using LaneFn = int (*)(const TaskDesc&, LaneState&, int, const DaemonParams&);

__device__ LaneFn SelectLane(const TaskDesc& d) {
  return ForLaneTypes<LaneFn>(d.kind, d.dtype, d.reduce, [&]<class Op, class T, class R>() -> LaneFn {
    return d.match == kMatchAnnounce ? &AnnounceLane<Op, T, R> : &RunLane<Op, T, R>;
  });
}

__device__ int Step(const TaskDesc& d, LaneState& s, int lane, const DaemonParams& P) {
  const LaneFn f = SelectLane(d);
  return f ? f(d, s, lane, P) : kDone;
}

struct Recorder {  // per-block trace ring and counters in device memory; this block is the only writer
  BlockStats* row = nullptr;  // none (an inline submit kernel): nothing recorded
  TraceRec* ring = nullptr;
  DFCCL_DEV void Load(const DaemonParams& P) {
    row = &P.dev->stats[blockIdx.x];
    ring = P.dev->trace[blockIdx.x];
  }
  DFCCL_DEV void Trace(const DaemonParams& P, const TaskDesc& d, uint16_t ev, uint16_t lane) {
    if (!P.trace || !row) return;
    const uint64_t h = row->trace_head;
    ring[h % kTracePerBlock] = TraceRec{GlobalTimer(), d.key_hash, d.ticket, static_cast<uint32_t>(d.seq), ev, lane};
    row->trace_head = h + 1;
  }
  DFCCL_DEV void Bump(uint64_t BlockStats::*field) {
    if (row) row->*field += 1;
  }
};

// The bucket-lock budget of the daemon's matching (a holder never waits inside).
constexpr int64_t kLockBudgetNs = 2000000;
// How often the control warp reads the host's words (aborts, resize: two reads
// across PCIe, ~1 µs each, so not on every pass), and looks at a slotted task's
// entry for a failure another rank decided.
constexpr uint64_t kHostPollNs = 50000;
constexpr uint64_t kFailCheckNs = 20000;

__device__ void CompleteTask(const DaemonParams& P, const TaskDesc& d, uint32_t e, bool aborted, Recorder& rec) {
  const uint32_t g = Gen(d.ticket);
  uint32_t status = kStatusOk;
  if (aborted) {
    status = LdVol(&P.dev->run[e].status);
    if (status == kStatusOk) status = kStatusAborted;
  }
  __threadfence();
  // The entry as recorded (by the submit kernel, or later by the control warp:
  // then the worker's copy may predate it).
  // The slot as this copy of the task has it (with its epoch: a worker runs a
  // task only then); -1: the entry's (an aborted task may have none yet).
  if (d.match == kMatchAnnounce) {
    // (no entry: the control warp finishes its handle once the task is done)
  } else if (d.match != kMatchIdentity)  // (an identity task has no entry)
    Leave(d.comm->table, d.match >= 0 ? d.match : LdVol(&P.dev->desc[e].match), d.nranks,
          d.epoch != 0 ? d.slot : -1, d.pool);
  else if (aborted && d.nranks > 1 && (status & 0xff) != kStatusMismatch && !d.tomb)  // (a tombstone's headers say so)
    MarkIdentityFailed(d);
  StVol(&P.dev->status[e], status);
  __threadfence_system();  // orders every earlier write of the task before done (a relaxed store suffices after it)
  StVol(&P.dev->done[e], g);
  StVol(&P.host->status[e], status);  // posted writes, in order: status before done
  StVol(&P.host->done[e], g);
  atomicAdd(&P.dev->progress, 1ull);
  rec.Trace(P, d, aborted ? kEvError : kEvFinish, 0);
  rec.Bump(&BlockStats::tasks_done);
  if (aborted) rec.Bump(&BlockStats::aborted);
}

__device__ void WorkerLoop(const DaemonParams& P) {
  __shared__ uint64_t cand[kMaxCand];
  __shared__ uint64_t window_lo, window_hi;
  __shared__ int ncand, stop, aborted;
  __shared__ TaskDesc sd;
  __shared__ LaneState ss;
  __shared__ Recorder rec;
  DeviceShared* dev = P.dev;
  const int b = blockIdx.x, tid = threadIdx.x;
  if (tid == 0) rec.Load(P);
  while (true) {
    // Block-uniform values only: every value that decides how many barriers a
    // thread passes is read once by thread 0 and shared (threads reading the
    // window bounds themselves could see different values and pass different
    // numbers of __syncthreads, silently desynchronising the block).
    if (tid == 0) {
      stop = LdVol(&dev->quit) == P.launch_id;
      ncand = 0;
      window_hi = LdAcquireGpu(&dev->submitted);
      window_lo = LdVol(&dev->lo);
    }
    __syncthreads();
    if (stop) break;
    const uint64_t sub = window_hi;
    const uint64_t lo = window_lo;
    for (uint64_t base = lo; base < sub; base += kThreads) {
      const uint64_t t = base + tid;
      if (t < sub) {
        const uint32_t e = t % kTaskRing, g = Gen(t);
        if (LdVol(&dev->done[e]) != g) {
          const bool ab = LdVol(&dev->run[e].aborted) != 0;
          const bool slotted = LdVol(&dev->desc[e].slot) >= 0;
          if ((slotted || ab) && LdVol(&dev->desc[e].lanes) > FirstLane(t, b, P.workers)) {
            const int i = atomicAdd(&ncand, 1);
            if (i < kMaxCand) cand[i] = t;
          }
        }
      }
      __syncthreads();
      if (ncand >= kMaxCand) break;
    }
    const int nc = min(ncand, kMaxCand);
    __syncthreads();
    // Nothing runnable: the scheduler's idle poll, not a wait on another agent (it
    // ends with the control warp's quit, after config idle/stall; docs/design/waits.md).
    if (nc == 0) { __nanosleep(64); continue; }
    for (int i = 0; i < nc; ++i) {
      const uint64_t t = cand[i];
      const uint32_t e = t % kTaskRing;
      if (tid < kDescWords)
        reinterpret_cast<uint4*>(&sd)[tid] = LdVolVec(reinterpret_cast<const uint4*>(&dev->desc[e]) + tid);
      __syncthreads();
      if (sd.ticket != t) { __syncthreads(); continue; }  // entry reused since the scan
      // The control warp sets epoch, then slot, once the instance has one; the
      // words above were read by different threads, so a slot without its epoch
      // (still 0: epochs start at 1) counts as none yet (skipped until a later pass).
      if (tid == 0 && *(volatile uint32_t*)&sd.epoch == 0) *(volatile int32_t*)&sd.slot = -1;
      __syncthreads();
      for (int l = FirstLane(t, b, P.workers); l < sd.lanes; l += P.workers) {
        if (tid == 0) {
          reinterpret_cast<uint4*>(&ss)[0] = LdVolVec(&dev->lane[e][l]);
          reinterpret_cast<uint4*>(&ss)[1] = LdVolVec(reinterpret_cast<const uint4*>(&dev->lane[e][l]) + 1);
          aborted = LdVol(&dev->run[e].aborted);
        }
        __syncthreads();
        if (ss.finished || (!aborted && sd.slot < 0)) { __syncthreads(); continue; }
        int r = kDone;
        if (!aborted) {
          __syncthreads();  // every thread has read ss above before thread 0 updates it
          if (tid == 0) {
            // volatile: the compiler must not hoist the read of `started` out of
            // this branch into every thread (a benign but real shared-memory race).
            volatile int32_t* started = &ss.started;
            if (!*started) { *started = 1; rec.Trace(P, sd, kEvRun, l); }
          }
          __syncthreads();
          r = Step(sd, ss, l, P);
        }
        __syncthreads();
        if (tid == 0) {
          rec.Bump(&BlockStats::steps);
          if ((r & kMoved) && ss.preempted) { ss.preempted = 0; rec.Trace(P, sd, kEvResume, l); rec.Bump(&BlockStats::resumes); }
          if (!(r & kDone) && !ss.preempted) { ss.preempted = 1; rec.Trace(P, sd, kEvPreempt, l); rec.Bump(&BlockStats::preempts); }
          if (r & kMoved) atomicAdd(&dev->progress, 1ull);
          if (r & kFailed) {  // the lane decided the task's failure: complete it with that status
            AbortRun(&dev->run[e], ss.fail);
            aborted = 1;
          }
          if (r & kDone) ss.finished = 1;
          LaneState* dst = &dev->lane[e][l];
          StVolVec(dst, reinterpret_cast<uint4*>(&ss)[0]);
          StVolVec(reinterpret_cast<uint4*>(dst) + 1, reinterpret_cast<uint4*>(&ss)[1]);
          if (r & kDone) {
            rec.Bump(&BlockStats::lanes_done);
            __threadfence();
            const int old = atomicAdd(&dev->run[e].lanes_done, 1);
            if (old + 1 == sd.lanes) { __threadfence(); CompleteTask(P, sd, e, aborted != 0, rec); }
          }
        }
        __syncthreads();
      }
      // Every thread has finished reading sd (lane count, slot) before the
      // next candidate overwrites it, also when this block had no lane of it.
      __syncthreads();
    }
  }
}

// Lane 0 of the control warp: brings pending tasks to their instance (arrival,
// slot, failure) — see device/match.cuh.  `aborts`: the host's abort words
// changed since the last pass.
__device__ void MatchPending(const DaemonParams& P, uint64_t lo, uint64_t sub, bool aborts, uint64_t now,
                             ann::Outbox* ob, AnnounceCache* cache) {
  DeviceShared* dev = P.dev;
  AnnouncePass pass(ob, cache);
  for (uint64_t t = lo; t < sub; ++t) {
    const uint32_t e = t % kTaskRing, g = Gen(t);
    TaskRun* run = &dev->run[e];
    if (LdVol(&dev->done[e]) == g) {
      if (LdVol(&run->ann)) AnnounceFinish(run, &dev->desc[e], cache);  // (protocol "announce")
      continue;
    }
    if (LdVol(&run->aborted)) {
      if (LdVol(&run->ann)) pass.Progress(LdVol(&dev->desc[e].comm)->ann);  // its members still get its records, releases
      continue;
    }
    TaskDesc* dd = &dev->desc[e];
    TaskDesc d;
    for (int i = 0; i < kDescWords; ++i) reinterpret_cast<uint4*>(&d)[i] = LdVolVec(reinterpret_cast<const uint4*>(dd) + i);
    const int phase = LdVol(&run->phase);
    const bool host_abort = aborts && LdVol(&P.host->abort[e]) == g;
    if (d.match == kMatchAnnounce) {
      AnnounceStep(run, dd, d, host_abort, pass);
      continue;
    }
    uint32_t why = 0;
    int r = phase == 2 ? kMatchSlotted : kMatchArrived;
    if (phase == 0) {
      const uint32_t fail = host_abort ? PackStatus(kStatusFailedPeer, d.rank, d.rank) : d.invalid;
      r = Arrive(d, dd, fail, &why, kLockBudgetNs / 4);
      if (r == kMatchRetry && d.invalid) { why = d.invalid; r = kMatchFailed; }
      if (r == kMatchRetry && host_abort) { why = PackStatus(kStatusNoEntry, d.rank, d.rank); r = kMatchFailed; }
      if (r == kMatchFailed && host_abort) why = kStatusAborted;  // the host's message names it
    } else if (host_abort) {
      if (d.match != kMatchIdentity) Fail(d, PackStatus(kStatusFailedPeer, d.rank, d.rank));
      why = kStatusAborted;
      r = kMatchFailed;
    } else if (phase == 1) {
      r = ClaimSlot(d, dd, &why, kLockBudgetNs / 4);
    } else if (d.match != kMatchIdentity && now - LdVol(&run->t_check) > kFailCheckNs) {  // slotted: look at the failure state now and then
      StVol(&run->t_check, now);
      why = CheckFailed(d);
      if (why) r = kMatchFailed;
    }
    if (r == kMatchFailed) {
      AbortRun(run, why);
      continue;
    }
    const int np = r == kMatchSlotted ? 2 : r == kMatchArrived ? 1 : 0;
    if (np != phase) StVol(&run->phase, np);
    if (np == 2 && phase != 2) StVol(&run->t_check, now);
  }
}

__device__ void ControlLoop(const DaemonParams& P) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  DeviceShared* dev = P.dev;
  HostShared* host = P.host;
  __shared__ ann::Outbox outbox;  // the messages a pass leaves to the whole warp (ShipOutbox)
  __shared__ AnnounceCache cache;  // groups spanning hosts: their protocol state while this daemon runs
  extern __shared__ __align__(16) char dyn[];
  if (lane == 0) {
    outbox.n = 0;
    cache.Init(dyn);
  }
  __syncwarp();
  Recorder rec;
  rec.Load(P);
  uint64_t sub = LdVol(&dev->submitted), lo = LdVol(&dev->lo);
  uint64_t seen_abort = ~0ull;
  unsigned long long last_prog = LdVol(&dev->progress);
  uint64_t t_prog = GlobalTimer(), t_busy = t_prog, t_host = 0;
  while (true) {
    // Ingest: published entries in ticket order (their descriptors are in place).
    // Polled relaxed, then one fence once something is published (an acquire load
    // per pass would invalidate this SM's L1, where the protocol state of groups
    // spanning hosts lives: device/announce_path.cuh).
    uint64_t hs = sub;
    if (lane == 0) {
      while (hs < sub + kTaskRing && LdVol(&dev->pub[hs % kTaskRing]) == Gen(hs)) ++hs;
      if (hs > sub) __threadfence();
    }
    hs = __shfl_sync(0xffffffffu, hs, 0);
    if (hs > sub) {  // (the submit kernel reset the entries' run and lane state)
      if (lane == 0) {
        StReleaseGpu(&dev->submitted, hs);
        for (uint64_t t = sub; t < hs; ++t) rec.Trace(P, dev->desc[t % kTaskRing], kEvStart, 0);
      }
      sub = hs;
    }
    // Host memory (abort_gen, resize) costs a PCIe round trip per read: looked
    // at every kHostPollNs only.  Abort words are read only in passes after the
    // host bumped abort_gen; the change is consumed once every taken ticket is
    // ingested (the host aborts only tickets whose record it saw, written after
    // `taken` grew).
    const uint64_t now = __shfl_sync(0xffffffffu, GlobalTimer(), 0);
    const uint64_t taken0 = __shfl_sync(0xffffffffu, lane == 0 ? LdVol(&dev->next_ticket) : 0ull, 0);
    bool aborts = false, resize = false;
    if (now - t_host >= kHostPollNs) {
      t_host = now;
      const uint64_t ag = __shfl_sync(0xffffffffu, lane == 0 ? LdVol(&host->abort_gen) : 0ull, 0);
      aborts = ag != seen_abort;
      if (aborts && taken0 <= sub) seen_abort = ag;
      resize = __shfl_sync(0xffffffffu, lane == 0 ? LdVol(&host->resize) : 0u, 0) == P.launch_id;
    }
    if (lane == 0) MatchPending(P, lo, sub, aborts, now, &outbox, &cache);
    __syncwarp();
    ShipOutbox(&outbox, &cache, lane);  // (the messages of groups spanning hosts: protocol "announce")
    if (lane == 0) {
      // (a done task that still holds an Announcer handle is finished by the next pass first)
      while (lo < sub && LdVol(&dev->done[lo % kTaskRing]) == Gen(lo) && LdVol(&dev->run[lo % kTaskRing].ann) == 0) ++lo;
      StVol(&dev->lo, lo);
    }
    lo = __shfl_sync(0xffffffffu, lo, 0);
    // Warp-uniform clock and progress (lane 0's), so every lane takes the same branch.
    const unsigned long long prog = __shfl_sync(0xffffffffu, LdVol(&dev->progress), 0);
    if (prog != last_prog) { last_prog = prog; t_prog = now; }
    // Tickets taken by submit kernels but not published yet count as pending.
    const uint64_t taken = __shfl_sync(0xffffffffu, lane == 0 ? LdVol(&dev->next_ticket) : 0ull, 0);
    if (lo < sub || taken > sub) t_busy = now;
    if (resize) {  // the host already queued the next daemon behind this one
      if (lane == 0) {
        cache.WriteBack();
        StVol(&dev->quit, P.launch_id);
      }
      break;
    }
    // Idle; stalled; or a lane needs a range mapped after this launch (direct.cuh):
    // the next daemon (launched by the proxy, which sees `exiting`) may read it.
    const bool stale = __shfl_sync(0xffffffffu, lane == 0 ? LdVol(&dev->stale_map) : 0u, 0) == P.launch_id;
    const bool quit = (lo == sub && taken == sub && now - t_busy > static_cast<uint64_t>(P.idle_ns)) ||
                      (lo < sub && now - t_prog > static_cast<uint64_t>(P.stall_ns)) || stale;
    if (quit) {
      // The host proxy relaunches a daemon that left while work arrives: it sees
      // the submit kernels' records (HostShared::sub) and `exiting`.
      if (lane == 0) {
        cache.WriteBack();
        StVol(&host->exiting, P.launch_id);
        __threadfence_system();
        StVol(&dev->quit, P.launch_id);
      }
      break;
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) DaemonKernel(DaemonParams P) {
  const bool control = static_cast<int>(blockIdx.x) == P.workers;
  if (control && threadIdx.x == 0) StVol(&P.dev->entered, P.launch_id);
  if (control) ControlLoop(P);
  else WorkerLoop(P);
  if (threadIdx.x == 0) atomicAdd(&P.dev->blocks_left, 1ull);  // (thread 0 leaves last: it decides when its block stops)
}

#if !defined(DFCCL_DAEMON_NVSHMEM)  // (the NVSHMEM module builds the daemon alone)
// The blocking form's submit kernel for pool-0 tasks (device/task.h, "inline"):
// once its task is matched (by identity at once; else its arrival got a slot),
// this block steps the task's lanes itself for up to p.inline_ns — the peers'
// side is their submit kernels or daemons.  An identity task whose lanes all
// finished is done then: no ticket, no ring entry, nothing for the daemon.
// Otherwise the task (with a ticket taken now, for an identity task) is
// published and completed here, or its unfinished lanes' state is left to the
// daemon.  Bounded, so it never holds up a task another rank waits for for long.
// One instantiation per (Op, T, R) of a pool-0 lane (InlineSubmitKernelFor: the
// host picks it per call site), so the lane code is inlined here: no function
// pointer, no step dispatch (measured: 2.7 us from the lane loop to the lane
// function through them, on an H200).
template <class Op, class T, class R>
__global__ void __launch_bounds__(kThreads, 1) InlineSubmitKernel(SubmitParams p) {
  __shared__ TaskDesc sd;
  __shared__ LaneState ss[kMaxLanes];
  __shared__ int go, ndone, more, ticketless, use_pre;
  __shared__ uint32_t fail;
  __shared__ uint64_t t_inline;  // start of the inline budget (p.inline_ns; device/wait.cuh Elapsed)
  __shared__ uint64_t stamps[kLaneStamps];
  __shared__ __align__(16) RunSlot line;  // the program's line of the book (thread 0 plans it, thread 32 stores it)
  __shared__ uint64_t ack_pre[kMaxRanks * kIdentityWays];  // identity: lane 0's credit words (AckPreRead)
  const int tid = threadIdx.x;
  const uint64_t t_enter = p.trace && tid == 0 ? GlobalTimer() : 0;
  uint64_t t_matched = 0, t_lane = 0;
  DaemonParams P{};
  P.dev = p.dev;
  P.host = p.host;
  P.spin_ns = p.spin_ns;
  P.sticky_max = p.sticky_max;
  P.stamps = p.trace ? stamps : nullptr;
  for (int l = tid; l < kMaxLanes; l += kThreads) ss[l] = LaneState{};
  if (tid < kLaneStamps) stamps[tid] = 0;
  // The sequence number first, and the communicator's device view into L1 (the
  // lane reads it): neither depends on the stream's earlier kernels, so with
  // programmatic launch (config.tuning.submit_pdl) both overlap the previous kernel's end.
  constexpr int kCommLines = (sizeof(CommDev) + 127) / 128;
  if (tid == 0) SubmitTake(p, sd);
  else if (tid >= 32 && tid < 32 + kCommLines) PrefetchL1(reinterpret_cast<const char*>(p.task.comm) + 128 * (tid - 32));
  GridDependencyWait();  // the stream's earlier kernels complete: the input is ready
  // An identity task's first claims need lane 0's credit words: warps 1.. read
  // them while thread 0 reads the book's line (one wait on memory, not two, before
  // the lane's claim; measured: the chain's book cost).  They are not used when
  // tombstones went first (their claims at the same cells make the words stale).
  const bool pre = p.task.match == kMatchIdentity && p.task.nranks > 1;
  if (pre) AckPreRead(p.task, 32, ack_pre);
  // With tracing on, an identity task takes its ticket first too: the trace's
  // stream events live in its ring entry.
  if (tid == 0) {
    const uint64_t seq0 = sd.seq;
    if (p.book > 0 && SubmitBookPlan(p, sd, SubmitBookRead(p), &line))  // (protocol "run": tombstones first)
      sd.invalid = PackStatus(kStatusLeftBehind, sd.rank, sd.rank);
    use_pre = pre && sd.seq == seq0;
    ticketless = sd.match == kMatchIdentity && !p.trace;
    if (ticketless) go = !sd.invalid && sd.lanes <= kMaxLanes;
    else go = SubmitMatch(p, sd) == kMatchSlotted && sd.lanes <= kMaxLanes && sd.pool == 0;
    if (p.trace) t_matched = GlobalTimer();
    ndone = 0;
    fail = 0;
    t_inline = GlobalTimer();
  }
  __syncthreads();
  // The line stored by a thread other than thread 0 (its stores overlap thread 0's
  // first step of the lane).
  static_assert(kThreads > 32, "thread 32 stores the book line");
  if (tid == 32 && p.book > 0) SubmitBookStore(p, line);
  if (p.trace && tid == 0) t_lane = GlobalTimer();
  if (go) {
    while (true) {
      for (int l = 0; l < sd.lanes; ++l) {
        if (ss[l].finished) continue;  // block-uniform: written by thread 0 between barriers
        const int r = RunLaneBody<Op, T, R, true>(sd, ss[l], l, P, l == 0 && use_pre ? ack_pre : nullptr);
        if (tid == 0 && (r & kFailed)) fail = ss[l].fail;  // left unfinished: the daemon completes it failed
        else if (tid == 0 && (r & kDone)) {
          ss[l].finished = 1;
          ndone++;
        }
        __syncthreads();
      }
      if (tid == 0) {
        more = !fail && ndone < sd.lanes && !Elapsed(t_inline, static_cast<uint64_t>(p.inline_ns));
        use_pre = 0;  // read once: a later pass reads the words afresh
      }
      __syncthreads();
      if (!more) break;
    }
  }
  const bool completed = go && !fail && ndone == sd.lanes;  // (block-uniform: written before the barriers)
  // The output stores (RunLaneBody leaves them unfenced here): a task completed
  // without a ticket needs no fence (the kernel's end orders them for the
  // stream's next kernels, and no other agent learns of it); for any other, the
  // publish and the completion below must follow every thread's stores.
  if (!(ticketless && completed)) {
    __threadfence();
    __syncthreads();
  }
  if (tid != 0) return;
  if (ticketless) {
    if (completed) {
      atomicAdd(&p.dev->identity_done, 1ull);
      return;
    }
    // Left to the daemon (slotted, or failed): a ticket now, the state so far.
    SubmitTicket(p, sd);
    const uint32_t why = sd.invalid ? sd.invalid : fail;
    const TaskRun run{0, why ? 1 : 0, 2, why, GlobalTimer(), 0};
    SubmitRun(p, sd, run, !go);
  } else if (fail) {
    AbortRun(&p.dev->run[sd.ticket % kTaskRing], fail);
  }
  const uint32_t e = sd.ticket % kTaskRing;
  if (go) {
    for (int l = 0; l < sd.lanes; ++l) {
      StVolVec(&p.dev->lane[e][l], reinterpret_cast<const uint4*>(&ss[l])[0]);
      StVolVec(reinterpret_cast<uint4*>(&p.dev->lane[e][l]) + 1, reinterpret_cast<const uint4*>(&ss[l])[1]);
    }
    StVol(&p.dev->run[e].lanes_done, ndone);
  }
  SubmitPublish(p, sd);  // before the completion: the ring entry cannot be reused meanwhile
  const uint64_t t_published = p.trace ? GlobalTimer() : 0;
  if (completed) {  // (every thread's output fenced above; CompleteTask fences again, cumulatively)
    Recorder none;
    CompleteTask(P, sd, e, false, none);
    atomicAdd(&p.dev->inline_done, 1ull);
  }
  if (p.trace) {
    StreamStamp(p.dev, sd, kEvSubmitEnter, t_enter);
    StreamStamp(p.dev, sd, kEvSubmitMatched, t_matched);
    StreamStamp(p.dev, sd, kEvSubmitPublished, t_published);
    if (go) {
      StreamStamp(p.dev, sd, kEvInlineLane, t_lane);
      for (int i = 0; i < kLaneStamps; ++i)
        if (stamps[i] != 0) StreamStamp(p.dev, sd, static_cast<TraceEvent>(kEvLaneEntered + i), stamps[i]);
    }
    if (completed) StreamStamp(p.dev, sd, kEvInlineCompleted, GlobalTimer());
  }
  // A task this kernel completed itself is done (status ok): no wait on its done word.
  if (p.wait && !completed) WaitDone(p.dev, sd.ticket, p.trap, p.trace, p.timeout_ns);
}

#endif  // !DFCCL_DAEMON_NVSHMEM

}  // namespace

#if !defined(DFCCL_DAEMON_NVSHMEM)
InlineSubmitFn InlineSubmitKernelFor(int32_t kind, int32_t dtype, int32_t reduce) {
  return ForLaneTypes<InlineSubmitFn>(kind, dtype, reduce, [&]<class Op, class T, class R>() -> InlineSubmitFn {
    return &InlineSubmitKernel<Op, T, R>;
  });
}

// Every instantiation (op kinds x element types x reduce ops of the tables; an op
// that does not reduce has one kernel for all reduce ops, loaded again: harmless).
cudaError_t PreloadInlineSubmit() {
  static constexpr int32_t kinds[] = {
#define DFCCL_X(E, name, id, reduces, rule, Trait) static_cast<int32_t>(OpKind::E),
      DFCCL_OP_TABLE(DFCCL_X)
#undef DFCCL_X
  };
  static constexpr int32_t dtypes[] = {
#define DFCCL_X(E, id, name, bytes, CType) static_cast<int32_t>(DType::E),
      DFCCL_DTYPE_TABLE(DFCCL_X)
#undef DFCCL_X
  };
  static constexpr int32_t reduces[] = {
#define DFCCL_X(E, name, id, Fn) static_cast<int32_t>(ReduceOp::E),
      DFCCL_REDUCE_TABLE(DFCCL_X)
#undef DFCCL_X
  };
  for (int32_t k : kinds)
    for (int32_t t : dtypes)
      for (int32_t r : reduces) {
        cudaFuncAttributes a;
        if (const cudaError_t e = cudaFuncGetAttributes(&a, InlineSubmitKernelFor(k, t, r)); e != cudaSuccess) return e;
      }
  return cudaSuccess;
}

#endif  // !DFCCL_DAEMON_NVSHMEM

DFCCL_DAEMON_BUILD_BEGIN
cudaError_t LaunchDaemon(const DaemonParams& params, cudaStream_t stream) {
  // (the control block's AnnounceCache: dynamic shared memory, so it may pass 48 KiB;
  // the kernel's attribute is per device, set at its first launch there)
  constexpr int kDyn = static_cast<int>(AnnounceCache::kBytes);
  static std::atomic<uint64_t> attributed{0};
  int dev = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint64_t bit = 1ull << (dev & 63);
  if (!(attributed.load(std::memory_order_relaxed) & bit)) {
    if (const cudaError_t e = cudaFuncSetAttribute(DaemonKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDyn);
        e != cudaSuccess)
      return e;
    attributed.fetch_or(bit, std::memory_order_relaxed);
  }
  DaemonKernel<<<params.workers + 1, kThreads, kDyn, stream>>>(params);
  return cudaGetLastError();
}
DFCCL_DAEMON_BUILD_END

}  // namespace dfccl::gpu
