// The formats shared by the GPU host runtime (xla_ffi/runtime) and the daemon
// kernel (xla_ffi/device): task descriptors, per-lane state, the communicator's
// device view, trace records and counters.  Compiled by both g++ and nvcc.
//
// Ordering protocol (who writes what, who reads it, and the fence between):
//
//  site         host, once per (call site, device): the task's static part (a
//               TaskDesc without buffers, ticket and sequence), kept on the host
//               and passed in every submit kernel's parameters (SubmitParams::task:
//               no dependent load before the sequence counter's atomic), and a
//               sequence counter per (communicator, key) in DeviceShared::seq_ctr.
//               From then on a start does no host work but one kernel launch, so
//               XLA can capture it into command buffers (CUDA graphs).  Launched
//               with programmatic stream serialization (config.tuning.submit_pdl), a
//               submit kernel takes its sequence number while the stream's previous
//               kernel finishes, and waits for it (griddepcontrol.wait) before it
//               reads the input or signals anything.
//  submit       the one-thread submit kernel on XLA's stream (device/submit_kernel.cu)
//               is also the *ready* signal: it runs once the kernels before it on
//               the stream are complete, so the input is.  seq = atomicAdd(seq_ctr),
//               ticket = atomicAdd(next_ticket); it waits (bounded) until the ring
//               entry's previous ticket is done, writes DeviceShared::desc[e], then
//               __threadfence() and st.release.gpu DeviceShared::pub[e] = Gen(ticket);
//               then the host record HostShared::sub[e] (site, seq, then gen last,
//               after __threadfence_system) for the proxy; start forms store the
//               ticket into the call's ticket buffer, which done reads.
//               Before publishing, the submit kernel resets the entry's run and
//               lane state and tries the match itself (below), so a task whose
//               instance had a free slot is runnable when it is ingested.
//  inline       the blocking form of a pool-0 (LL) task, SubmitParams::inline_ns
//               > 0: the submit kernel is one block of kThreads threads; once its
//               arrival got a slot it steps the task's lanes itself (the same lane
//               functions as the daemon; the peers' side is their submit kernels
//               or daemons) for at most inline_ns, writes the lane states and
//               run.lanes_done, publishes the task, and completes it if every lane
//               finished; else the daemon resumes the lanes from their state.
//               Publishing before completing keeps the ring entry from being
//               reused while it is written (its ticket is not done yet).
//  identity     pool-0 tasks of a communicator with CommDev::identity (the default,
//               config.tuning.small_by_identity) skip the match table.  The key picks a
//               bucket of IdentityWays pool-0 slots (IdentityBucket, in TaskDesc::slot)
//               and (key, sequence) the LL flag (IdentityTag), on every rank alike,
//               so a sender writes its lines into the receiver's staging at once,
//               without waiting for any arrival, into any way of the bucket whose
//               cell (slot, sender, lane) at that receiver is free; the receiver
//               looks for its instance's tag in the bucket's headers.  Per cell:
//               the sender's header word (tag << 32 | signature bits) in the
//               receiver's pool-0 flags (another signature fails the task naming
//               both ranks), and two 32-bit words in the sender's pool-0 credits:
//               [0] the tag the receiver consumed last (written by the receiver),
//               [1] the tag the sender wrote last.  A sender claims a cell whose
//               words are equal and not its own tag (one relaxed 64-bit load of
//               both, every way at once, then a 64-bit atom.acquire.sys.cas of the
//               cell that keeps [0] and sets [1]: the acquire orders the header and
//               lines after the receiver's consumption; senders of one GPU may race
//               for it; the receiver never writes [0] while the words are equal), so the cell's old lines
//               can never pass for the new message's.  The receiver, once every
//               thread read its lines and used the values (a barrier), stores the
//               consumed tag, with no fence (the reads are complete; header and
//               lines stay, the next message has another tag).  A rank whose task fails (not by a mismatch, which
//               every receiver finds itself) rewrites the headers it sent with
//               signature bits 0 (a CAS of the exact header; no signature has them), so a rank that starts the
//               instance later fails it too, naming that rank.  The blocking form's inline kernel takes no ticket
//               when every lane finished inside its budget; else it takes one and
//               publishes the task slotted (phase 2), and the daemon resumes its
//               lanes.  Capacity: a sender with every way of a bucket at one
//               receiver holding messages of instances that receiver has not started
//               waits (preemptibly) until it starts one of them.
//  ingest       the control warp advances DeviceShared::submitted over published
//               entries in ticket order.
//  match        the submit kernel (first try) and the control warp's lane 0
//               (retries, failures) bring each task to its
//               instance's entry of the communicator's MatchTable (device memory of
//               the communicator's rank 0, reached over NVLink): lock the bucket
//               (atomicCAS_system), find or claim the entry of (key_hash, seq),
//               compare signatures, set the rank's arrival bit, claim an instance
//               slot of the pool from the table's bitmap (slot epochs live there
//               too) if the entry has none, unlock (fence.sys, atomicExch_system).
//               The task's desc gets epoch, then (after __threadfence) slot: worker
//               blocks run a task only once its slot is set.  A slot freed later is
//               claimed by the next pass of any rank's control warp (retry; no rank
//               ever blocks on a slot).  Failure (mismatch, a host abort, a rank
//               that failed it first) is a state of the entry; each rank's control
//               warp sees it (polled every ~20 us while its task pends) and aborts
//               its own task.
//  done         the daemon writes DeviceShared::status[e], then done[e] = Gen(ticket)
//               (st.release.sys after __threadfence_system), and the same two words
//               in HostShared for the proxy.  The done kernel (or the blocking form's
//               submit kernel) polls done[e] with ld.acquire.sys; one word per ring
//               entry, generations only grow, so an out-of-order completion of
//               another task never releases it early.  The last rank of an instance
//               to complete frees its slot, then its entry (a release store of
//               id = 0; no lock: no rank touches the entry any more).
//  data         a sender stores a chunk into the receiver's staging, __syncthreads,
//               fence.sys, then st.release.sys of the arrival flag; the receiver
//               ld.acquire.sys the flag, __syncthreads, then reads staging with
//               ld.global.cg (never through L1: the daemon is persistent and L1 is
//               not coherent).  Credits flow back the same way.  Flag and credit
//               values are (epoch << 32) | count and never reset, so values of an
//               earlier instance that used the same slot are always smaller.
//  direct       (TaskDesc::direct, pool 1): no staging; lanes read peers' inputs and
//               write peers' outputs in place between a ready and a finished
//               handshake per lane (protocol in device/direct.cuh; the pool's
//               credits carry "ready", its flags "finished", and CommDev::mail the
//               buffer addresses).  Across processes a mailbox address carries
//               the range tag of its buffer in its top bits (XAddr): the
//               receiver maps it through the sender's range table
//               (CommDev::xmap, runtime/ipc.h) and waits while the range is not
//               mapped yet.
//  staged       a start form's task never touches XLA's buffers, so a program that
//               stops between a start and its done (XLA frees its buffers and never
//               runs the done) leaves nothing of it in use.  Per call site and device
//               the host allocates kStageSlots slots of [input | output] and a
//               SiteStage header (runtime memory; exportable across processes, so
//               the direct path reads and writes the slot in place).  Call c uses
//               slot c % kStageSlots.  On XLA's stream: the *stage kernel* copies the
//               operand (and ragged_all_to_all's initial output) into the slot once
//               the task of the slot's previous call is complete (its done word;
//               whether its done ran or its program was abandoned, it no longer
//               uses the slot); a block that finds it in use copies nothing and
//               sets `skipped`.  The submit kernel (after the stage kernel, in
//               stream order) gives the task the slot's buffers, fails it with
//               kStatusStageBusy when `skipped` names its call, else makes it the
//               slot's owner, and counts `calls`.  The done kernel waits for the
//               task and copies the slot's output into the done's result (a result
//               of more than one copy block: a one-block kernel waits and leaves the
//               slot in `done_slot`, then the copy kernel's grid copies, so no more
//               than one block per done spins while the daemon needs the SMs); a done
//               whose slot has another owner (more than kStageSlots starts of one
//               call site in flight before their dones) traps rather than return
//               another call's result.  The three run in stream order, so these
//               words need no fences beyond the kernel boundaries; the daemon and
//               the peers see the slot's input as they see XLA's operand otherwise
//               (the submit kernel runs after the kernel that wrote it).  The
//               blocking form keeps XLA's buffers: its kernel returns only once its
//               task is complete, so no program stops while the task uses them.
//  announce     a group spanning hosts (docs/design/announce.md; CommDev::ann):
//               its tasks (TaskDesc::match kMatchAnnounce) take no match-table
//               entry, no identity cell and no inline run.  The control warp's lane
//               0 starts each in the communicator's Announcer (protocol C of
//               transport/announce.cuh: its own table, announcements to every
//               member, the message put into each member's announced receive slot),
//               keeps the handle in TaskRun::ann (1 + it), and advances every
//               announced communicator of its pending tasks once a pass; a task
//               ready there gets its slot (epoch 1, then slot), so the workers'
//               lanes combine the members' messages into the output; a failure
//               there aborts it with the Announcer's status.  The task's handle
//               is finished (its receive slot released) by the control warp once
//               the task is done; `lo` never passes a task whose handle is held.
//  run          across processes (docs/design/execution_identity.md): a start
//               carries its execution's launch id (XLA's RunId; TaskDesc::run):
//               the handler's, outside a command buffer (SubmitParams::run); inside
//               one, DeviceShared::run_word, which the initialize stage of the
//               execution's first start wrote on XLA's stream before its thunks
//               (a one-thread kernel).  A start of a group spanning processes
//               (SubmitParams::book > 0) reads its program's line of the key as
//               its kernel begins (every writer of a line fences before it exits,
//               so the stream's previous kernel's count is there) and, once the
//               stream's earlier kernels are complete, counts itself in it
//               (DeviceShared::run_slot, dfccl/execution.h RunSlotStart; the host
//               opens the line and writes its call sites at XLA's initialize stage,
//               and adds to run_owed what the device's failures say is owed): when
//               its process ran an execution that started the key fewer times than
//               the program does (the execution failed before those starts), it
//               first submits that many *tombstones* (TaskDesc::tomb) for the key,
//               which take the sequence numbers the failed execution would have taken.
//               A tombstone arrives failed (kStatusLeftBehind, its rank) at a match
//               entry, so the peers' tasks of that instance (their processes' copy
//               of the failed execution) fail naming it; by identity it sends each
//               receiver a header with signature bits kSigLeftBehind and no lines,
//               then consumes the message each peer sent it for the tag (its lines
//               complete first), never writing an output.  Its own status is not an
//               error: the host records tombstones apart.  A match entry keeps the
//               first arrival's launch id (MatchEntry::run); a later arrival whose
//               id is a nearby one of the same program (CompareRuns) fails the
//               instance (kStatusLeftBehind, naming the earlier run's rank), so two
//               executions that do not belong together never pair silently.
#pragma once

#include <cstdint>

#include "dfccl/collective.h"
#include "dfccl/execution.h"

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
inline constexpr int kMaxKeys = 4096;       // (communicator, key) sequence counters per device
inline constexpr int kRunSlots = 2048;      // lines of the execution book per device (protocol "run")
inline constexpr int kMaxTombstones = 256;  // tombstones one start submits at most (protocol "run")
inline constexpr int kMatchBuckets = 256;   // MatchTable geometry: buckets x ways entries
inline constexpr int kMatchWays = 16;
inline constexpr int kMaxPoolSlots = 1024;  // instance slots per pool (config *_slots)

// A task's outcome (DeviceShared/HostShared::status): the code in the low byte,
// then the two ranks it names (a mismatch: the first rank and the disagreeing one).
enum TaskStatus : uint32_t {
  kStatusOk = 0,
  kStatusAborted = 1,       // aborted by the host (watchdog: timeout); the host wrote the message
  kStatusMismatch = 2,      // ranks started the instance with different signatures
  kStatusFailedPeer = 3,    // another rank (another process) failed the instance first
  kStatusTwice = 4,         // a rank started the same (key, sequence) twice
  kStatusUnaligned = 5,     // LL pool buffers not 16-byte aligned
  kStatusNoEntry = 6,       // the match table had no free entry in the instance's bucket until the abort
  kStatusStageBusy = 7,     // start form: the call site's staging slot still held by an unfinished instance
  kStatusLeftBehind = 8,    // rank a's process left the instance's execution behind (protocol "run"): its program
                            // failed before it started it (a tombstone), or rank b arrived from another execution
};
// Signature bits of an identity header (protocol "identity"): a site's own are odd
// (DaemonPath::Prepare), so the even values below name a failure, not a signature.
inline constexpr uint32_t kSigFailed = 0;      // the sender failed the instance
inline constexpr uint32_t kSigLeftBehind = 2;  // the sender is a tombstone (protocol "run")
DFCCL_TASK_HD uint32_t PackStatus(uint32_t code, int a, int b) {
  return code | (static_cast<uint32_t>(a & 0xff) << 8) | (static_cast<uint32_t>(b & 0xff) << 16);
}

// Identity of an instance in the match table (never 0: 0 marks a free entry).
DFCCL_TASK_HD uint64_t MatchId(uint64_t key_hash, uint64_t seq) {
  uint64_t z = key_hash ^ (seq + 0x9e3779b97f4a7c15ull) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z ? z : 1;
}
DFCCL_TASK_HD int MatchBucket(uint64_t id) { return static_cast<int>((id >> 40) % kMatchBuckets); }

DFCCL_TASK_HD uint32_t Gen(uint64_t ticket, uint64_t ring = kTaskRing) { return static_cast<uint32_t>(ticket / ring + 1); }

inline constexpr int64_t kDirectChunk = 64 << 10;  // direct path: largest chunk of the unit (lanes take turns)

// The range the lanes of a direct-path task split (equal on every rank): an
// all-reduce's segment (one per rank, 16-byte multiple), else the per-peer message.
DFCCL_TASK_HD int64_t DirectUnitBytes(int32_t kind, int64_t msg_bytes, int32_t nranks) {
  if (kind != static_cast<int32_t>(OpKind::kAllReduce)) return msg_bytes;
  return ((msg_bytes + nranks - 1) / nranks + 15) / 16 * 16;
}

// kEvStreamWait/kEvStreamWoke: XLA's stream reached the done wait / saw the task done.
// kEvSubmitEnter/Matched/Published: the submit kernel began, had arrived at the
// instance (sequence number, ticket, match), had published the task (the inline
// kernel: after running its lane).  The inline kernel's steps in between:
// kEvInlineLane (its lane loop begins), kEvLaneEntered (it entered the lane
// code), kEvLaneReady (its prologue read the
// communicator and sent), kEvLanePolled (it saw every source's lines),
// kEvLaneCombined (its output stored), kEvLaneFenced (the output fence passed:
// the lane is done), and kEvInlineCompleted (it completed the task:
// match-table leave, done words).
enum TraceEvent : uint16_t {
  kEvStart = 0, kEvRun = 1, kEvPreempt = 2, kEvResume = 3, kEvFinish = 4, kEvError = 5,
  kEvStreamWait = 6, kEvStreamWoke = 7, kEvSubmitEnter = 8, kEvSubmitMatched = 9, kEvSubmitPublished = 10,
  kEvInlineLane = 11, kEvLaneEntered = 12, kEvLaneReady = 13, kEvLanePolled = 14, kEvLaneCombined = 15,
  kEvLaneFenced = 16, kEvInlineCompleted = 17, kNumTraceEvents = 18
};
// Their names (the host's trace records; one table for the runtime and its tests).
inline constexpr const char* kTraceEventNames[kNumTraceEvents] = {
    "start", "run", "preempt", "resume", "finish", "error", "stream_wait", "stream_woke", "submit_enter",
    "submit_matched", "submit_published", "inline_lane", "lane_entered", "lane_ready", "lane_polled",
    "lane_combined", "lane_fenced", "inline_completed"};
// The events XLA's stream records per ring entry (DeviceShared::stream_trace):
// slot s holds event kEvStreamWait + s.
inline constexpr int kNumStreamEvents = kEvInlineCompleted - kEvStreamWait + 1;
// Slots of DaemonParams::stamps (a lane's own steps, kEvLaneEntered + i).
inline constexpr int kLaneStamps = kEvLaneFenced - kEvLaneEntered + 1;

// One staging pool of a communicator: `nslots` instance slots, each holding, per
// (source rank, lane), a ring of `depth` chunks of `chunk_bytes`.
struct PoolGeom {
  int32_t lanes = 0, depth = 0, nslots = 0, pad = 0;
  int64_t chunk_bytes = 0;
};

struct MatchTable;
struct AnnounceView;  // device/announce_path.cuh: a communicator matched by announcements (protocol "announce")

// Across processes, the direct path reaches another process's XLA buffers
// through the allocations that hold them, each exported once by its owner
// (runtime/ipc.h) and mapped by every peer process.  A range's tag (1 ..
// kMaxXRanges - 1, per owner process; 0: none) travels with the buffer's address
// in the mailbox: XAddr(address, tag), the tag above bit kXTagShift.
inline constexpr int kMaxXRanges = 4096;
inline constexpr int kXTagShift = 48;  // device addresses are below 2^48
// TaskDesc::direct: bit 0 the direct path; then the input's and the output's range tags.
DFCCL_TASK_HD int32_t DirectTags(int in_tag, int out_tag) { return (in_tag << 1) | (out_tag << 13); }
DFCCL_TASK_HD int XTagIn(int32_t direct) { return (direct >> 1) & (kMaxXRanges - 1); }
DFCCL_TASK_HD int XTagOut(int32_t direct) { return (direct >> 13) & (kMaxXRanges - 1); }
DFCCL_TASK_HD uint64_t XAddr(const void* p, int tag) {
  return reinterpret_cast<uint64_t>(p) | (static_cast<uint64_t>(tag) << kXTagShift);
}
// One entry of an owner process's range table in a peer (pinned host memory the
// GPUs read, written once by the peer's serving thread, local_base last; 0: not
// mapped; runtime/ipc.h).
struct XRange {
  uint64_t remote_base;  // the range in its owner's address space
  uint64_t size;
  uint64_t local_base;   // where this process mapped it
  uint64_t gen;          // mappings this process had made once this one was (Ipc::gen(); 1, 2, ...)
};

// A communicator as the daemon sees it (a copy in each member's device memory).
// All pointers are UVA addresses on the device of rank r.
struct CommDev {
  int32_t nranks = 0;
  int32_t identity = 0;  // 1: pool-0 instances are matched by identity in the staging (protocol "identity")
  PoolGeom pool[kNumPools];
  char* stage[kNumPools][kMaxRanks];        // [slot][src][lane][depth][chunk_bytes]
  uint64_t* flags[kNumPools][kMaxRanks];    // [slot][src][lane]: chunks arrived at r from src
  uint64_t* credits[kNumPools][kMaxRanks];  // [slot][dst][lane]: chunks dst consumed from r
  uint64_t* mail[kMaxRanks];                // [slot][src][2]: src's (in, out) of the pool-1 instance (direct path)
  MatchTable* table;                        // the communicator's match table (rank 0's device memory)
  const XRange* xmap[kMaxRanks];            // per rank of another process: its process's range table; else null
  char* ann_region[kMaxRanks];              // protocol "announce": each rank's region (transport/announce_layout.cuh)
  const AnnounceView* ann;                  // ... this rank's view of them (its own device copy; null: not announced)
};

// One instance (group, key, sequence) being matched.  Written under its bucket's
// lock, except `done` (atomicAdd_system) and `failed` (atomicCAS_system from 0).
struct alignas(64) MatchEntry {
  uint64_t id;         // MatchId(key_hash, seq); 0: free
  uint64_t key_hash;
  uint64_t seq;
  uint64_t sig;        // signature hash of the first rank to arrive
  uint32_t arrived;    // ranks that arrived
  uint32_t done;       // ranks whose task completed (the n-th frees slot and entry)
  int32_t slot;        // instance slot of `pool`; -1 until claimed
  uint32_t epoch;      // the slot's generation for this instance
  uint32_t failed;     // PackStatus(code, rank, rank) of the failure; 0: none
  int32_t first_rank;  // rank that created the entry
  int32_t pool;
  uint32_t run;        // launch id of the first arrival that had one (protocol "run"; 0: none)
};
static_assert(sizeof(MatchEntry) == 64, "MatchEntry is one 64-byte line");

// Per communicator, in the device memory of its rank 0 (peer access / CUDA IPC).
struct MatchTable {
  uint32_t lock[kMatchBuckets];                                    // 0 free, 1 held
  MatchEntry entry[kMatchBuckets][kMatchWays];
  unsigned long long free_bits[kNumPools][kMaxPoolSlots / 64];    // 1: slot free
  uint32_t epoch[kNumPools][kMaxPoolSlots];                        // generation of each slot's latest use
};

// One rank's part of one collective instance: the static part is written by the
// host per call site (DeviceShared::site), the rest by the submit kernel.
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
  int32_t slot;          // instance slot in the pool; -1 until the match assigns one
  uint32_t epoch;        // generation of the slot's use (flag/credit high word)
  int32_t site;          // DeviceShared::site index (host records)
  int32_t direct;        // bit 0: direct path (peers' buffers in place; lanes split the unit of device/direct.cuh); DirectTags
  int32_t match;         // MatchTable entry (bucket * kMatchWays + way); -1 until the rank arrived;
                         // kMatchIdentity: matched by identity in the staging (protocol
                         // "identity"; `slot` is the key's bucket, its first slot)
  uint64_t sig_hash;     // hash of CollectiveSpec::Signature() (ranks must agree)
  int32_t key_ctr;       // DeviceShared::seq_ctr index of (communicator, key)
  uint32_t invalid;      // TaskStatus the submit kernel found (kStatusUnaligned), 0: none
  uint32_t run;          // launch id of the execution that started it (protocol "run"; 0: unknown)
  int32_t tomb;          // 1: a tombstone (protocol "run"): no buffers, its status is not an error
  uint64_t in_bytes;     // kMatchAnnounce: the input's bytes (its message to every member)
};
static_assert(sizeof(TaskDesc) == 160, "TaskDesc is 10 x 16 bytes (copied as uint4 words)");
inline constexpr int kDescWords = sizeof(TaskDesc) / 16;

// The index of cell (slot, rank, lane) in a pool's flags and credits, and of its
// chunk ring in the staging (times depth * chunk_bytes): [slot][rank][lane], where
// rank is the source (flags, staging) or the destination (credits).
DFCCL_TASK_HD size_t PoolCell(int64_t slot, int nranks, int rank, int lanes, int lane) {
  return (static_cast<size_t>(slot) * nranks + rank) * lanes + lane;
}

inline constexpr int32_t kMatchIdentity = -2;  // TaskDesc::match of a task matched by identity
inline constexpr int32_t kMatchAnnounce = -3;  // ... of a task of a group spanning hosts (protocol "announce")

DFCCL_TASK_HD uint64_t IdentityMix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Protocol "identity": a key's bucket of kIdentityWays consecutive pool-0 slots
// (fewer when the pool has fewer); a sender writes an instance's message into
// any way of the bucket whose cell at that receiver is free, and the receiver
// finds it by its tag.  Returns the bucket's first slot.
inline constexpr int kIdentityWays = 8;
DFCCL_TASK_HD int32_t IdentityWays(int32_t nslots) { return nslots < kIdentityWays ? nslots : kIdentityWays; }
DFCCL_TASK_HD int32_t IdentityBucket(uint64_t key_hash, int32_t nslots) {
  const int32_t ways = IdentityWays(nslots);
  const uint64_t buckets = static_cast<uint64_t>(nslots / ways);
  return static_cast<int32_t>(IdentityMix(key_hash) % buckets) * ways;
}
// Its LL flag: never 0 (the tag of a cell never written), distinct for every
// sequence number of a key (an odd multiplier is a bijection mod 2^32).
DFCCL_TASK_HD uint32_t IdentityTag(uint64_t key_hash, uint64_t seq) {
  const uint32_t t = static_cast<uint32_t>(IdentityMix(key_hash ^ 0x5bd1e9955bd1e995ull)) +
                     static_cast<uint32_t>(seq) * 0x9e3779b1u;
  return t != 0 ? t : 0x9e3779b1u;
}

// Per-lane progress, kept in global memory so a preempted lane resumes where it stopped.
struct alignas(16) LaneState {
  int32_t c_send;    // next chunk to send (direct: the handshake phase)
  int32_t p_send;    // next peer for chunk c_send
  int32_t c_recv;    // next chunk to receive/combine (direct: steps moved)
  int32_t finished;
  int32_t sticky;    // adaptive spin budget exponent
  int32_t started;
  int32_t preempted;
  uint32_t fail;     // TaskStatus the lane decided (identity: a peer's header with another signature)
};

struct alignas(16) TaskRun {
  int32_t lanes_done;
  int32_t aborted;
  int32_t phase;      // matching: 0 not arrived, 1 arrived without a slot, 2 slot set (control warp only)
  uint32_t status;    // TaskStatus of an abort decided on the device (0: the host's)
  uint64_t t_check;   // %globaltimer of the last look at the entry's failure state
  uint64_t ann;       // protocol "announce": 1 + the task's handle in its Announcer (0: none)
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

// A submission as the host proxy sees it (written by the submit kernel, gen last).
inline constexpr int32_t kTombSite = 1 << 30;  // SubRec::site of a tombstone: its site | kTombSite (protocol "run")
struct alignas(16) SubRec {
  uint64_t seq;
  int32_t site;  // the call site's index; a tombstone's: index | kTombSite
  uint32_t gen;  // Gen(ticket) of entry e = ticket % kTaskRing
};

// Host-mapped (cudaHostAlloc, mapped): written by the device, read by the host, and back.
struct HostShared {
  volatile uint32_t exiting;     // launch id of a daemon that decided to quit
  volatile uint32_t resize;      // launch id the host asks to quit (relaunched with another grid)
  volatile uint64_t abort_gen;   // bumped after the host sets some abort[e]
  volatile uint32_t done[kTaskRing];    // mirror of DeviceShared::done
  volatile uint32_t status[kTaskRing];  // TaskStatus (valid once done[e] == Gen)
  volatile uint32_t abort[kTaskRing];   // Gen(ticket): the host watchdog aborts that task
  SubRec sub[kTaskRing];                // submissions, for the proxy (watchdog, relaunch, stats)
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
  uint64_t submitted;            // tickets below it are ingested (published by the control warp)
  uint64_t lo;                   // all tickets below lo are complete
  unsigned long long progress;   // bumped on every unit of work
  unsigned long long next_ticket;  // taken by submit kernels (atomicAdd)
  uint32_t quit;                 // launch id whose daemon must exit
  uint32_t stale_map;            // launch id of a daemon a lane of which needs a newer mapping (it leaves, the proxy relaunches)
  uint32_t entered;              // launch id of the latest daemon whose control block started (for pending())
  uint32_t run_word;             // the launch id of the execution on XLA's stream (protocol "run")
  unsigned long long blocks_left;  // daemon blocks that returned, over every launch (for pending())
  uint32_t pub[kTaskRing];       // Gen(ticket) once the submit kernel wrote desc[e]
  uint32_t done[kTaskRing];      // waited on by XLA's stream
  uint32_t status[kTaskRing];    // TaskStatus, written before done[e]
  TaskRun run[kTaskRing];
  TaskDesc desc[kTaskRing];
  unsigned long long seq_ctr[kMaxKeys];  // starts of each (communicator, key) by this device
  RunSlot run_slot[kRunSlots];           // the execution book's lines (protocol "run"; runtime/run_book.h)
  int64_t run_owed[kRunSlots];           // starts the host found owed per line, a running total (written by the host)
  LaneState lane[kTaskRing][kMaxLanes];
  // Counters and trace ring per block (the control block's row is `workers`);
  // device memory, copied out by the host on demand (no PCIe writes on the hot path).
  BlockStats stats[kMaxBlocks];
  unsigned long long inline_done;       // tasks their submit kernels completed themselves (atomicAdd; read with stats)
  unsigned long long identity_done;     // ... of them without a ticket (protocol "identity"; the host counts them
                                        // as started and completed)
  TraceRec trace[kMaxBlocks][kTracePerBlock];
  TraceRec stream_trace[kTaskRing][kNumStreamEvents];  // per ring entry, slot s: event kEvStreamWait + s (XLA's stream)
};

// A start form's staging (protocol "staged"): per call site and device, in its
// device memory, this header and kStageSlots slots of [input | output].
inline constexpr int kStageSlots = 2;
struct alignas(16) SiteStage {
  uint64_t calls;                      // starts of the site so far (the stage kernel reads, the submit kernel counts)
  uint64_t skipped;                    // 1 + a call whose stage kernel found its slot held (its task fails)
  uint64_t owner_ticket[kStageSlots];  // 1 + the ticket of the call that uses the slot (0: never used)
  uint64_t done_slot;                  // a large done's wait kernel tells its copy kernel: 1 + the slot (0: failed)
};
struct StageView {                   // where a staged site's buffers are (kernel parameters)
  SiteStage* state;
  char* slot[kStageSlots];           // input at slot[s], output at slot[s] + out_off
  int64_t out_off;
  int32_t tags[kStageSlots];         // direct path across processes: DirectTags of the slot's input and output
};

// Kernel parameters of a submit kernel (and of the blocking form's, which also waits).
struct SubmitParams;
using InlineSubmitFn = void (*)(SubmitParams);  // an inline submit kernel (device/daemon.h)

struct SubmitParams {
  TaskDesc task;         // the call site's static task (protocol "site"; buffers, ticket and sequence filled in)
  DeviceShared* dev;
  HostShared* host;      // device address of the mapped block
  const char* in;
  char* out;
  int64_t* ticket_out;   // start form: where done finds the ticket
  int32_t site;          // the call site's index (the host's records)
  int32_t wait;          // blocking form: wait for the task's done word too
  int32_t trap;          // a failed task traps the stream (inside a command buffer no handler reports it)
  int32_t trace;
  int64_t timeout_ns;    // bound of every wait (a dead daemon or a full ring)
  int64_t inline_ns;     // > 0 (blocking form, pool 0): the submit kernel runs the matched task itself this long
  int64_t spin_ns;       // the lanes' spin budget then (DaemonParams::spin_ns)
  int32_t sticky_max;
  int32_t tags;          // direct path across processes: DirectTags of in and out (or'ed into TaskDesc::direct)
  StageView stage;       // a start form's staging: the task's buffers are the slot's (stage.state null: XLA's in, out)
  uint32_t run;          // the execution's launch id (protocol "run"; 0: DeviceShared::run_word, inside a command buffer)
  int32_t book;          // 1 + the line of the start's program in DeviceShared::run_slot (protocol "run"); 0: none
  InlineSubmitFn inline_kernel;  // host only: the call site's inline submit kernel (InlineSubmitKernelFor), or null
};

// Kernel parameters of the stage kernel (a start form's copy into its slot, on XLA's stream).
struct StageParams {
  StageView stage;
  DeviceShared* dev;
  const char* in;        // XLA's operand
  const char* init;      // ragged_all_to_all: the output's initial values (else null)
  int64_t in_bytes, out_bytes;
};

// Kernel parameters of a done wait (daemon ring).
struct DoneParams {
  DeviceShared* dev;
  const int64_t* ticket;
  int32_t trap, trace;
  int64_t timeout_ns;
  StageView stage;       // the start form's staging (every start form is staged)
  char* result;          // the done's result, which the done kernel fills from the slot's output
  int64_t out_bytes;
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
  uint64_t* stamps;      // null (the daemon); the inline kernel with trace on: the lane's
                         // kLaneStamps step times (shared memory, thread 0 writes)
  uint64_t map_gen;      // Ipc::gen() at the launch: the lanes use no range mapped later (XRange::gen)
};

}  // namespace dfccl::gpu
