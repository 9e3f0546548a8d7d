// The formats shared by the GPU host runtime (xla_ffi/runtime) and the daemon
// kernel (xla_ffi/device): task descriptors, per-lane state, the communicator's
// device view, trace records and counters.  Compiled by both g++ and nvcc.
//
// Ordering protocol (who writes what, who reads it, and the fence between):
//
//  submission   host: fills HostShared::desc[e] (e = ticket % kTaskRing), then
//               stores HostShared::submitted = ticket + 1 (x86 stores are ordered,
//               a std::atomic_thread_fence(release) sits between).  The daemon's
//               control warp reads `submitted` (volatile, system scope), copies
//               the new descriptors into DeviceShared::desc, resets their run and
//               lane state, __threadfence()s, then publishes DeviceShared::submitted.
//  ready        XLA's stream writes DeviceShared::ready[e] = Gen(ticket) with
//               cuStreamWriteValue32_v2 (default flags: a memory barrier precedes
//               the write, so the input buffer is complete when the flag is seen).
//  done         the daemon writes DeviceShared::done[e] = Gen(ticket) after a
//               __threadfence_system(); XLA's stream waits with
//               cuStreamWaitValue32_v2(GEQ Gen(ticket)).  One word per ring entry,
//               generations only grow, so an out-of-order completion of another
//               task can never release this wait early.  HostShared::done[e]
//               mirrors it for the host proxy (slot recycling, watchdog).
//  data         a sender stores a chunk into the receiver's staging, __syncthreads,
//               fence.sys, then st.release.sys of the arrival flag; the receiver
//               ld.acquire.sys the flag, __syncthreads, then reads staging with
//               ld.global.cg (never through L1: the daemon is persistent and L1 is
//               not coherent).  Credits flow back the same way.  Flag and credit
//               values are (epoch << 32) | count and never reset, so values of an
//               earlier instance that used the same slot are always smaller.
//  direct       (TaskDesc::direct, pool 1, one process): no staging; lanes read
//               peers' inputs and write peers' outputs in place between a ready
//               and a finished handshake per lane (protocol in device/direct.cuh;
//               the pool's credits carry "ready", its flags "finished", and
//               CommDev::mail the buffer addresses).
#pragma once

#include <cstdint>

#include "dfccl/collective.h"

#if defined(__CUDACC__)
#define DFCCL_TASK_HD __host__ __device__ __forceinline__
#else
#define DFCCL_TASK_HD inline
#endif

namespace dfccl::gpu {

inline constexpr int kTaskRing = 1024;      // tasks in flight per device
inline constexpr int kMaxRanks = 8;         // ranks per communicator
inline constexpr int kMaxLanes = 64;        // lanes per task (a lane = one block's share)
inline constexpr int kMaxBlocks = 64;       // worker blocks of a daemon
inline constexpr int kThreads = 512;        // threads per daemon block
inline constexpr int kTracePerBlock = 2048; // trace ring entries per block
inline constexpr int kNumPools = 2;         // 0: small messages (LL protocol), 1: the rest (simple protocol)
inline constexpr int kCeRing = 1024;        // copy-engine collectives in flight per device (runtime/copy_engine.h)

DFCCL_TASK_HD uint32_t Gen(uint64_t ticket, uint64_t ring = kTaskRing) { return static_cast<uint32_t>(ticket / ring + 1); }

inline constexpr int64_t kDirectChunk = 64 << 10;  // direct path: largest chunk of the unit (lanes take turns)

// The range the lanes of a direct-path task split (equal on every rank): an
// all-reduce's segment (one per rank, 16-byte multiple), else the per-peer message.
DFCCL_TASK_HD int64_t DirectUnitBytes(int32_t kind, int64_t msg_bytes, int32_t nranks) {
  if (kind != static_cast<int32_t>(OpKind::kAllReduce)) return msg_bytes;
  return ((msg_bytes + nranks - 1) / nranks + 15) / 16 * 16;
}

// kEvStreamWait/kEvStreamWoke: XLA's stream reached the done wait / saw the task done.
enum TraceEvent : uint16_t {
  kEvStart = 0, kEvRun = 1, kEvPreempt = 2, kEvResume = 3, kEvFinish = 4, kEvError = 5,
  kEvStreamWait = 6, kEvStreamWoke = 7, kNumTraceEvents = 8
};

// One staging pool of a communicator: `nslots` instance slots, each holding, per
// (source rank, lane), a ring of `depth` chunks of `chunk_bytes`.
struct PoolGeom {
  int32_t lanes = 0, depth = 0, nslots = 0, pad = 0;
  int64_t chunk_bytes = 0;
};

// A communicator as the daemon sees it (a copy in each member's device memory).
// All pointers are UVA addresses on the device of rank r.
struct CommDev {
  int32_t nranks = 0, pad = 0;
  PoolGeom pool[kNumPools];
  char* stage[kNumPools][kMaxRanks];        // [slot][src][lane][depth][chunk_bytes]
  uint64_t* flags[kNumPools][kMaxRanks];    // [slot][src][lane]: chunks arrived at r from src
  uint64_t* credits[kNumPools][kMaxRanks];  // [slot][dst][lane]: chunks dst consumed from r
  uint64_t* mail[kMaxRanks];                // [slot][src][2]: src's (in, out) of the pool-1 instance (direct path)
};

// Host-written description of one rank's part of one collective instance.
struct alignas(16) TaskDesc {
  uint64_t ticket;
  uint64_t key_hash;
  uint64_t seq;
  const char* in;
  char* out;
  const CommDev* comm;   // this device's copy
  int64_t msg_bytes;     // bytes exchanged with each peer (E * elem_bytes)
  int64_t lane_bytes;    // bytes of the message each lane moves (direct: the chunk size)
  int32_t kind, reduce, elem_bytes, nranks;
  int32_t rank, send_to, recv_from, pool;
  int32_t lanes, vec;    // lanes used; vec: 16-byte vector path allowed
  int32_t dtype;         // dfccl::DType
  int32_t slot;          // instance slot in the pool; -1 until the host assigns one
  uint32_t epoch;        // generation of the slot's use (flag/credit high word)
  int32_t abort;         // set by the host watchdog
  int32_t direct;        // 1: direct path (peers' buffers in place; lanes split the unit of device/direct.cuh)
  int32_t pad;
};
static_assert(sizeof(TaskDesc) == 128, "TaskDesc is 8 x 16 bytes (copied as uint4 words)");
inline constexpr int kDescWords = sizeof(TaskDesc) / 16;

// Per-lane progress, kept in global memory so a preempted lane resumes where it stopped.
struct alignas(16) LaneState {
  int32_t c_send;    // next chunk to send (direct: the handshake phase)
  int32_t p_send;    // next peer for chunk c_send
  int32_t c_recv;    // next chunk to receive/combine (direct: steps moved)
  int32_t finished;
  int32_t sticky;    // adaptive spin budget exponent
  int32_t started;
  int32_t preempted;
  int32_t pad;
};

struct alignas(16) TaskRun {
  int32_t lanes_done;
  int32_t aborted;
  int32_t pad[2];
};

// Written by the daemon, one row per block (no atomics).
struct BlockStats {
  uint64_t preempts, resumes, steps, lanes_done, tasks_done, trace_head, aborted, pad;
};

struct TraceRec {
  uint64_t t_ns;
  uint64_t key_hash;
  uint64_t ticket;
  uint32_t seq;
  uint16_t event, lane;
};
static_assert(sizeof(TraceRec) == 32, "TraceRec is 32 bytes");

// Host-mapped (cudaHostAlloc, mapped): written by the host, read by the daemon, and back.
struct HostShared {
  volatile uint64_t submitted;   // tickets [0, submitted) are published
  volatile uint64_t abort_gen;   // bumped after the host sets some desc[e].abort
  volatile uint32_t exiting;     // launch id of a daemon that decided to quit
  volatile uint32_t resize;      // launch id the host asks to quit (relaunched with another grid)
  volatile uint64_t pad1;
  volatile uint32_t done[kTaskRing];    // mirror of DeviceShared::done
  volatile uint32_t status[kTaskRing];  // 0 ok, 1 aborted (valid once done[e] == Gen)
  TaskDesc desc[kTaskRing];
  // Copy-engine collectives (runtime/copy_engine.h), entry e = ticket % kCeRing:
  // XLA's stream writes ce_ready[e] = Gen(ticket) (stream memory write, after its
  // input is complete) and waits for ce_done[e] >= Gen(ticket); the copy streams
  // write ce_done[e] once every rank's copies that touch this rank's buffers are
  // complete (the host writes it when it aborts the collective or fails to issue
  // it; the error then reaches the program through the runtime's device error).
  volatile uint32_t ce_ready[kCeRing];
  volatile uint32_t ce_done[kCeRing];
};

// Device memory, one per device.
struct DeviceShared {
  uint64_t submitted;            // published by the control warp after ingest
  uint64_t lo;                   // all tickets below lo are complete
  unsigned long long progress;   // bumped on every unit of work
  uint32_t quit;                 // launch id whose daemon must exit
  uint32_t pad;
  uint32_t ready[kTaskRing];     // written by XLA's stream (stream memory op)
  uint32_t done[kTaskRing];      // waited on by XLA's stream
  TaskRun run[kTaskRing];
  TaskDesc desc[kTaskRing];
  LaneState lane[kTaskRing][kMaxLanes];
  // Counters and trace ring per block (the control block's row is `workers`);
  // device memory, copied out by the host on demand (no PCIe writes on the hot path).
  BlockStats stats[kMaxBlocks];
  TraceRec trace[kMaxBlocks][kTracePerBlock];
  TraceRec stream_trace[kTaskRing][2];  // per ring entry: kEvStreamWait, kEvStreamWoke (written by the wait kernel)
};

// Kernel parameters of one daemon launch.
struct DaemonParams {
  DeviceShared* dev;
  HostShared* host;      // device address of the mapped host block
  uint32_t launch_id;
  int32_t workers;       // worker blocks; block `workers` is the control block
  int64_t spin_ns;       // base spin budget (%globaltimer ns) before a waiting lane is preempted
  int32_t sticky_max;    // budget grows up to spin_ns << sticky_max
  int32_t trace;
  int64_t idle_ns;       // quit after this long with nothing pending
  int64_t stall_ns;      // quit after this long without progress while tasks are pending
};

}  // namespace dfccl::gpu
