// The persistent daemon kernel: `workers` worker blocks run collective lanes,
// one control block (warp 0) ingests submissions from host memory, retires
// completed tickets, applies aborts and decides to quit.
//
// Scheduling: worker block b owns lanes l == b (mod workers) of every task.
// Each pass scans the window [lo, submitted) in parallel, collects tasks that
// are ready (or aborted) and not done, and gives each of its lanes one step
// (RunLane) under a spin budget; a lane that cannot move is preempted and the
// block goes on to the next task.  The last lane to finish completes the task.
#include <cstdio>

#include "device/collectives/all_gather.cuh"
#include "device/collectives/all_reduce.cuh"
#include "device/collectives/all_to_all.cuh"
#include "device/collectives/broadcast.cuh"
#include "device/collectives/ppermute.cuh"
#include "device/collectives/ragged_all_to_all.cuh"
#include "device/collectives/reduce_scatter.cuh"
#include "device/daemon.h"
#include "dfccl/dtype.h"

namespace dfccl::gpu {
namespace {

constexpr int kMaxCand = 64;

// The one step dispatch, generated from the op table (dfccl/ops.h): (op kind,
// reduce op) here, the element type through DispatchDType.  It selects the lane function and calls it from one call site
// (a call site per instantiation would each reserve its own stack: kilobytes of
// local memory per thread).
using LaneFn = int (*)(const TaskDesc&, LaneState&, int, const DaemonParams&);

__device__ LaneFn SelectLane(const TaskDesc& d) {
  return DispatchDType<CudaTypes>(static_cast<DType>(d.dtype), [&]<class T>() -> LaneFn {
    auto reduced = [&]<class Op>() -> LaneFn {
      return DispatchReduce(static_cast<ReduceOp>(d.reduce), [&]<class R>() -> LaneFn { return &RunLane<Op, T, R>; });
    };
    switch (static_cast<OpKind>(d.kind)) {
#define DFCCL_X(E, name, id, reduces, rule, Trait)                  \
  case OpKind::E:                                                  \
    if constexpr (reduces) return reduced.template operator()<Trait>(); \
    else return &RunLane<Trait, T, SumOp>;
      DFCCL_OP_TABLE(DFCCL_X)
#undef DFCCL_X
    }
    return nullptr;
  });
}

__device__ int Step(const TaskDesc& d, LaneState& s, int lane, const DaemonParams& P) {
  const LaneFn f = SelectLane(d);
  return f ? f(d, s, lane, P) : kDone;
}

struct Recorder {  // per-block trace ring and counters in device memory; this block is the only writer
  BlockStats* row;
  TraceRec* ring;
  DFCCL_DEV void Load(const DaemonParams& P) {
    row = &P.dev->stats[blockIdx.x];
    ring = P.dev->trace[blockIdx.x];
  }
  DFCCL_DEV void Trace(const DaemonParams& P, const TaskDesc& d, uint16_t ev, uint16_t lane) {
    if (!P.trace) return;
    const uint64_t h = row->trace_head;
    ring[h % kTracePerBlock] = TraceRec{GlobalTimer(), d.key_hash, d.ticket, static_cast<uint32_t>(d.seq), ev, lane};
    row->trace_head = h + 1;
  }
  DFCCL_DEV void Bump(uint64_t BlockStats::*field) { row->*field += 1; }
};

__device__ void CompleteTask(const DaemonParams& P, const TaskDesc& d, uint32_t e, bool aborted, Recorder& rec) {
  const uint32_t g = Gen(d.ticket);
  __threadfence_system();
  StReleaseSys(&P.dev->done[e], g);
  StVol(&P.host->status[e], aborted ? 1u : 0u);  // posted writes, in order: status before done
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
          const bool rdy = static_cast<int32_t>(LdVol(&dev->ready[e]) - g) >= 0;
          if ((rdy || ab) && LdVol(&dev->desc[e].lanes) > b) {
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
    if (nc == 0) { __nanosleep(64); continue; }
    for (int i = 0; i < nc; ++i) {
      const uint64_t t = cand[i];
      const uint32_t e = t % kTaskRing;
      if (tid < kDescWords)
        reinterpret_cast<uint4*>(&sd)[tid] = LdVolVec(reinterpret_cast<const uint4*>(&dev->desc[e]) + tid);
      __syncthreads();
      if (sd.ticket != t) { __syncthreads(); continue; }  // entry reused since the scan
      // A slot the host assigned after submission: read it from host memory (epoch
      // first written there, slot last).  Epochs start at 1, so a copy whose epoch
      // is still 0 is not assigned yet, whatever its slot says.
      if (tid == 0 && (*(volatile int32_t*)&sd.slot < 0 || *(volatile uint32_t*)&sd.epoch == 0)) {  // thread 0 alone
        const int32_t slot = LdVol(&P.host->desc[e].slot);
        __threadfence_system();
        const uint32_t epoch = LdVol(&P.host->desc[e].epoch);
        if (slot >= 0 && epoch != 0) {
          sd.epoch = epoch;
          sd.slot = slot;
          StVol(&dev->desc[e].epoch, epoch);
          __threadfence();
          StVol(&dev->desc[e].slot, slot);
        } else {
          sd.slot = -1;
        }
      }
      for (int l = b; l < sd.lanes; l += P.workers) {
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

__device__ void ControlLoop(const DaemonParams& P) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  DeviceShared* dev = P.dev;
  HostShared* host = P.host;
  Recorder rec;
  rec.Load(P);
  uint64_t sub = LdVol(&dev->submitted), lo = LdVol(&dev->lo);
  uint64_t seen_abort = ~0ull;
  unsigned long long last_prog = LdVol(&dev->progress);
  uint64_t t_prog = GlobalTimer(), t_busy = t_prog;
  while (true) {
    const uint64_t hs = __shfl_sync(0xffffffffu, lane == 0 ? LdVol(&host->submitted) : 0ull, 0);
    if (hs > sub) {  // ingest: 8 x 16 bytes per descriptor, 4 descriptors per warp pass
      const uint64_t count = hs - sub;
      for (uint64_t i = lane; i < count * kDescWords; i += 32) {
        const uint32_t e = (sub + i / kDescWords) % kTaskRing;
        const uint4 v = LdVolVec(reinterpret_cast<const uint4*>(&host->desc[e]) + i % kDescWords);
        reinterpret_cast<uint4*>(&dev->desc[e])[i % kDescWords] = v;
      }
      for (uint64_t t = sub; t < hs; ++t) {
        const uint32_t e = t % kTaskRing;
        for (int l = lane; l < kMaxLanes * 2; l += 32) reinterpret_cast<uint4*>(&dev->lane[e][0])[l] = make_uint4(0, 0, 0, 0);
        if (lane == 0) dev->run[e] = TaskRun{0, 0, {0, 0}};
      }
      __threadfence();
      __syncwarp();
      if (lane == 0) {
        StReleaseGpu(&dev->submitted, hs);
        for (uint64_t t = sub; t < hs; ++t) rec.Trace(P, dev->desc[t % kTaskRing], kEvStart, 0);
      }
      sub = hs;
    }
    const uint64_t ag = __shfl_sync(0xffffffffu, lane == 0 ? LdVol(&host->abort_gen) : 0ull, 0);
    if (ag != seen_abort) {
      seen_abort = ag;
      for (uint64_t t = lo + lane; t < sub; t += 32) {
        const uint32_t e = t % kTaskRing;
        if (LdVol(&host->desc[e].abort)) StVol(&dev->run[e].aborted, 1);
      }
      __threadfence();
      __syncwarp();
    }
    if (lane == 0) {
      while (lo < sub && LdVol(&dev->done[lo % kTaskRing]) == Gen(lo)) ++lo;
      StVol(&dev->lo, lo);
    }
    lo = __shfl_sync(0xffffffffu, lo, 0);
    // Warp-uniform clock and progress (lane 0's), so every lane takes the same branch.
    const uint64_t now = __shfl_sync(0xffffffffu, GlobalTimer(), 0);
    const unsigned long long prog = __shfl_sync(0xffffffffu, LdVol(&dev->progress), 0);
    if (prog != last_prog) { last_prog = prog; t_prog = now; }
    if (lo < sub) t_busy = now;
    const bool resize = __shfl_sync(0xffffffffu, lane == 0 ? LdVol(&host->resize) : 0u, 0) == P.launch_id;
    if (resize) {  // the host already queued the next daemon behind this one
      if (lane == 0) StVol(&dev->quit, P.launch_id);
      break;
    }
    const bool quit = (lo == sub && now - t_busy > static_cast<uint64_t>(P.idle_ns)) ||
                      (lo < sub && now - t_prog > static_cast<uint64_t>(P.stall_ns));
    if (quit) {
      // Dekker with the host: it stores `submitted` then loads `exiting`; we
      // store `exiting` then load `submitted`.  One of us sees the other.
      int stay = 0;
      if (lane == 0) {
        StVol(&host->exiting, P.launch_id);
        __threadfence_system();
        if (LdVol(&host->submitted) > sub) { stay = 1; StVol(&host->exiting, 0u); }
        else StVol(&dev->quit, P.launch_id);
      }
      stay = __shfl_sync(0xffffffffu, stay, 0);
      if (!stay) break;
      t_prog = t_busy = now;
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) DaemonKernel(DaemonParams P) {
  if (static_cast<int>(blockIdx.x) == P.workers) ControlLoop(P);
  else WorkerLoop(P);
}

}  // namespace

cudaError_t LaunchDaemon(const DaemonParams& params, cudaStream_t stream) {
  DaemonKernel<<<params.workers + 1, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace dfccl::gpu
