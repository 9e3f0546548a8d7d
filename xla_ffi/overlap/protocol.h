// Shared host/device definitions of the fused overlap ops (GEMM+RS, AG+GEMM).
//
// Memory-ordering protocol (one Mailbox per channel = device group x key;
// every rank of the group runs its own instance of the op, numbered by `seq`,
// the collective's sequence number, which the host counts per (channel, rank)
// at enqueue; SPMD keeps them equal):
//
//  * Mailbox (host-mapped, one per channel, readable/writable by every GPU):
//      recv[p], flags[p]  rank p's persistent receive buffer and flag array
//                         (device memory of p), written once by p's host thread
//                         before p enqueues anything for the channel.
//      ready[p]           written by p's *stream* (cuStreamWriteValue32, which
//                         orders it after all prior work of that stream) at the
//                         start of p's instance `seq`: from then on p's previous
//                         instance no longer reads recv[p], so peers may write it.
//      ready_in[p]        address of rank p's device-memory announcement words
//                         (kMaxRanks u32): slot q holds the latest instance that
//                         rank q announced to p (see below).
//      error              first timeout code (kernel writes, host reports).
//  * Announcements in device memory: once the host of rank q knows p's
//    ready_in (from q's second call on, as a rule), the first thread of q's
//    fused GEMM kernel of instance seq stores seq into ready_in_p[q]
//    (st.release.sys over NVLink).  The kernel starts after all prior work of
//    q's stream, so this says the same as ready[q] >= seq, but p polls it in
//    its own memory instead of host memory over PCIe.  A waiter for a peer's
//    readiness polls its local slot and, every kHostPollEvery polls, the host
//    word ready[q] as well: either one suffices, so a rank whose peer does not
//    know its address yet (first calls) is served by the host word.  The
//    ready_in words are zeroed once (stream-ordered, before the rank's first
//    ready write); a peer's store lost to that zeroing only sends the waiter
//    to the host word.
//  * Peers' buffer addresses come from the host (kernel parameters) once
//    every rank of the group initialized; before that a kernel reads them from
//    the mailbox after seeing ready[p] >= seq.
//  * A writer waits ready[p] >= seq (ld.acquire.sys, bounded) before its first
//    remote store into recv[p] for instance seq, stores the data, syncs the
//    storing threads (bar.sync) and then one thread executes fence.acq_rel.sys
//    (cumulative: it orders the CTA's stores that the barrier ordered before
//    it) and sets the flag word flags[p][...] = seq with st.relaxed.sys (the
//    fence and the strong store form a release pattern).
//    Without kModeCtaFence (config overlap_cta_fence=False) every storing
//    thread runs fence.sc.sys (__threadfence_system) before the barrier
//    instead (the first version's scheme; the AG SM push kernel always does).
//  * AG with the copy engine (kModeCopyEngine, once both ranks' buffers are
//    known to the host): on the side stream a one-thread kernel waits ready[p]
//    (bounded), cudaMemcpyAsync copies the rows into recv[p] (copy engine over
//    NVLink, no SMs), and a signal kernel, stream-ordered after the copy, runs
//    fence.sc.sys and sets every chunk flag with st.release.sys.
//  * RS with the copy engine (kModeRsCopyEngine, 2 ranks, buffers known): the
//    peer block's tiles go to the local recv slot `rank` (unused otherwise);
//    after each tile one thread runs fence.acq_rel.sys and increments a local
//    done counter; the side stream waits (one-thread kernel, bounded) for the
//    counter to reach the block's tiles and for the peer's ready, copies the
//    block into the peer's slot `rank` and raises every tile flag (as above).
//  * A reader polls its own flag word with ld.acquire.sys until >= seq (bounded)
//    and only then reads the data (TMA readers also issue fence.proxy.async).
//  * Flags hold the instance number, so they never need resetting; a rank's op
//    completes only after it consumed every flag of its instance (so no peer
//    writes into its buffers after its completion), and the pushes it sends
//    finish before its op completes (the side stream joins the main stream).
//  * Every wait is bounded (globaltimer).  A kernel cannot fail the FFI call
//    that launched it (the handler returned long before), and a timed-out
//    wait must never let the op produce a result that looks valid.  So on
//    timeout the waiter records `error` (what, waiter, peer), fences
//    (fence.sc.sys: the code is in host memory before the kernel dies) and
//    executes `trap`; a waiter of any rank that finds `error` set traps too.
//    The trap fails the XLA execution holding the op on each such GPU (a CUDA
//    launch failure when its results are awaited; the CUDA context of that
//    GPU is lost, so the process must restart to use it): no rank consumes a
//    partial result.  The key, sequence and ranks come from the host
//    (runtime/overlap_path.cc PollChannel): it applies the same bound to each
//    instance from the moment its rank's stream reached it (ready word), names
//    the ranks whose ready word never reached the sequence, and writes `error`
//    itself, so that every waiter of the channel traps; the group's
//    communicator records the message (stats()["errors"], stderr,
//    raise_if_failed() and the device's next call: DEADLINE_EXCEEDED).  This trades the process's GPU state for never
//    returning garbage; the bound (config.timeout_s, the one user timeout)
//    trips only when a peer never arrives, where the alternative is a hang.
//    A waiter reads `error` (host memory) only every kErrorPollEvery polls,
//    the first time after that many, so a short wait makes no PCIe read.
#pragma once

#include <cstdint>

namespace dfccl::overlap {

constexpr int kMaxRanks = 8;
constexpr int kTileM = 128;  // GEMM tile rows == AG arrival-chunk rows
// GEMM tile columns: one of kTileNs per launch (GemmLaunch::tile_n), chosen by
// the host per shape (plan.cc, ChooseTileN) or forced by the mode bits
// below.  Every rank of a group computes the same choice from the shape, so
// the RS flags (one per tile) mean the same tiles on every rank.  Buffers
// sized per tile (RS flags, split partials) are sized for the extreme one.
constexpr int kTileNs[] = {128, 192, 256};
constexpr int kTileNMin = 128, kTileNMax = 256;

enum Kind : int32_t { kAllGatherGemm = 0, kGemmReduceScatter = 1 };

// Bits of the custom call's `mode` attribute (jax_dfccl.config).
// kModeMailboxOnly (diagnostic, no config entry): announcements and addresses
// only through the host-mapped mailbox (the first version's handshake).
// kModeClusterM2 (config overlap_cluster_m=2): the GEMM's 2x1-cluster variant.
// kModeNoSplit (config overlap_split_last_wave=False): no split of a partial
// last wave's tiles (gemm_sched.cuh), every unit a whole tile.
enum Mode : int32_t {
  kModeCopyEngine = 1,
  kModeCtaFence = 2,
  kModeRsCopyEngine = 4,
  kModeMailboxOnly = 8,
  kModeClusterM2 = 16,
  kModeNoSplit = 32,
  kModeClusterAuto = 64,  // config overlap_cluster_m=0: the host picks 1x1 or 2x1 per launch (plan.cc)
  kModeNoPdl = 128,       // config overlap_pdl=False: the GEMM launches without programmatic serialization
  // config overlap_tile_n: bits 8..9 hold 0 (the host picks per shape) or
  // 1 + the index of the forced width in kTileNs.
  kModeTileShift = 8,
  kModeTileMask = 768,
  // config overlap_raster: bits 10..12 hold 0 (the plan's order) or 1 + the
  // index of a forced order in kRasters.
  kModeRasterShift = 10,
  kModeRasterMask = 7168,
  kModeTmaStore = 8192,  // config overlap_tma_store=True: the epilogue's own-output stores through TMA (1x1 clusters)
  kModeTmaStoreAuto = 16384,  // config overlap_tma_store=None: the plan picks them per launch (plan.cc PlanLaunch)
  kModePingpong = 32768       // config overlap_pingpong=True: the GEMM's ping-pong variant (LaunchPlan::pingpong)
};

// Orders of the tiles of a row block (gemm_sched.cuh Decode): the n tiles in
// groups of `group_n` columns (0: all of them), a group after another, and
// inside a group the m tiles outer and n inner (m_fast = 0) or n outer and m
// inner (m_fast = 1; with group_n = 1 CUTLASS's raster "along M").  The
// first is the default (LaunchPlan).
struct Raster {
  int32_t m_fast, group_n;
};
constexpr Raster kRasters[] = {{0, 8}, {1, 1}, {0, 0}, {1, 4}, {1, 8}, {0, 2}};

// Profile timeline (globaltimer ns, written only when GemmLaunch::tl is set):
// per tile t of the launch kTlWords words at tl[t * kTlWords]: consumer got the
// tile, MMA done, waits done (RS: ready / peers' partials), epilogue done
// (flag raised), AG producer row-flag wait start, its end, SM id.  After the
// tiles, per peer j = 1..P-1 (AG copy engine; RS copy engine: j = 1) kTlSide
// words: ready wait start, ready seen, signal (copy done).  The last side
// slot (kTlLaunch) holds the kernel's start (first thread of block 0) and the
// time its announcements to the peers were stored.
constexpr int kTlWords = 8;
constexpr int kTlSide = 4;
constexpr int kTlLaunch = kMaxRanks - 1;  // side slot of the launch record (P - 1 < kMaxRanks)

// Poll periods of the bounded waits (sync.cuh), in polls of ~100 ns or more.
constexpr uint32_t kHostPollEvery = 256;    // host word ready[q] (first calls) beside the local announcement
constexpr uint32_t kTimerPollEvery = 128;   // the timeout (GPU clock)
constexpr uint32_t kErrorPollEvery = 2048;  // the mailbox error word (a peer timed out); a multiple of the above

// What a timed-out waiter was waiting for (bits 24..31 of the error code).
enum WaitWhat : uint32_t {
  kWaitReady = 1, kWaitPartial = 2, kWaitRows = 3, kWaitPushReady = 4, kWaitOwnTiles = 5,
  kWaitSplit = 6  // a split tile's owner for the f32 partials of its other chunks (local, gemm_sched.cuh)
};

struct Mailbox {
  uint32_t ready[kMaxRanks];
  uint32_t error;  // 0 or (what << 24) | (waiter << 16) | (peer << 8) | 1
  uint32_t pad[7];
  uint64_t recv[kMaxRanks];
  uint64_t flags[kMaxRanks];
  uint64_t ready_in[kMaxRanks];
};

constexpr uint32_t ErrorCode(uint32_t what, int waiter, int peer) {
  return (what << 24) | (uint32_t(waiter) << 16) | (uint32_t(peer) << 8) | 1u;
}

// How a launch is cut into work (gemm_sched.cuh), decided on the host from the
// shape, the `mode` bits and the device alone (plan.cc PlanLaunch), so every
// rank of a group makes the same plan and so the same tile grid (the RS flags
// are one per tile of it).
struct LaunchPlan {
  int32_t tile_n = kTileNMax;  // tile columns, one of kTileNs (tiles are kTileM x tile_n)
  int32_t cluster_m = 1;       // 1: one CTA per tile; 2: 2x1 clusters on tile pairs (gemm_sched.cuh)
  int32_t tiles = 0;           // whole tiles of every row block
  int32_t units = 0;           // work units: nranks x ceil(m tiles / cluster_m) x n tiles, or with
                               // a split last wave (cluster_m = 1): tiles - sk_tiles + sk_units
  // Split last wave (gemm_sched.cuh): the last sk_tiles tiles of the order
  // are split into s = sk_units / sk_tiles equal k ranges, one unit each
  // (chunk-major); 0: none.  Chunks 0 .. s-2 leave their f32 accumulator in
  // GemmLaunch::sk_partials[unit - (units - sk_units)] and raise
  // sk_flags[same] = seq (release, GPU scope); the last chunk owns the tile:
  // it adds the partials and runs the tile's epilogue (its store, signal or
  // fold), so a tile's signal still covers the whole tile.
  int32_t sk_units = 0, sk_tiles = 0;
  int32_t grid = 0;            // CTAs (cluster_m = 2: even)
  int32_t pdl = 0;             // programmatic dependent launch (gemm_launch.cuh LaunchConfig, gemm.cuh GridDependencyWait)
  Raster raster = kRasters[0];  // order of a row block's tiles (gemm_sched.cuh Decode)
  // The epilogue stores tiles whose destination is this rank's own output (AG;
  // RS on one rank) through the tensor memory accelerator (gemm.cuh: bulk
  // tensor stores from the staging tile, the consumers not waiting for them);
  // 1x1 clusters and those op kinds only (PlanLaunch sets it for no other);
  // forced by kModeTmaStore, or picked under kModeTmaStoreAuto (the default)
  // for launches of more than one wave.  Other tiles (RS peers' partials, the
  // fold) keep the threads' stores.
  int32_t tma_store = 0;
  // The ping-pong schedule (gemm.cuh; 1x1 clusters, 128-column tiles): each
  // of the two consumer warp groups computes a whole tile of its own, the
  // CTA's units alternating between them; their mainloops take turns on the
  // tensor cores, so one group's epilogue runs while the other's mainloop
  // does (the cooperative schedule, 0: both groups on one tile, the
  // epilogue between two mainloops).  Set by kModePingpong only: on one
  // H200, the GEMM alone, it was slower than the cooperative schedule on
  // most of the 22 benchmark shapes (plan.cc Pingpong).
  int32_t pingpong = 0;
};

// One launch of the fused GEMM (both kinds; no CUTLASS types here).
struct GemmLaunch {
  int32_t kind = kAllGatherGemm;
  int32_t rank = 0, nranks = 1;
  int32_t mb = 0, n = 0, k = 0;         // row-block rows, columns, contraction
  const void* a[kMaxRanks] = {};        // A of row block b: row-major [mb, k]
  const void* w = nullptr;              // row-major [k, n]
  void* out = nullptr;                  // AG: [P*mb, n]; RS: [mb, n]
  const void* local_recv = nullptr;     // RS: this rank's recv [P][mb][n]
  uint32_t* local_flags = nullptr;      // this rank's flag array
  uint32_t* tile_counter = nullptr;     // dynamic tile scheduler (never reset: every launch takes
  uint32_t tile_base = 0;               // exactly plan.units + plan.grid / plan.cluster_m values; base = its first)
  Mailbox* mbox = nullptr;
  uint32_t seq = 0;
  uint64_t timeout_ns = 0;
  LaunchPlan plan;                      // tile width, clusters, units, split, grid (plan.h)
  float* sk_partials = nullptr;         // split last wave: local [plan.sk_units][kTileM * plan.tile_n]
  uint32_t* sk_flags = nullptr;         // local [plan.sk_units], instance numbers (never reset)
  int32_t no_comm = 0;  // diagnostic: no waits, no remote stores (GEMM cost alone; results invalid)
  int32_t thread_fences = 0;  // RS: every storing thread fences (else one fence per CTA)
  uint64_t* tl = nullptr;     // profile timeline (see kTlWords) or null
  void* send = nullptr;               // RS copy engine: peer block's partials go here (local)
  uint32_t* done_counter = nullptr;   // RS copy engine: +1 per finished peer tile (never reset)
  // Known to the host once every rank initialized (else 0 / null: mailbox and host words).
  uint64_t peer_recv[kMaxRanks] = {};    // RS: rank p's recv buffer
  uint64_t peer_flags[kMaxRanks] = {};   // RS: rank p's flag array
  uint32_t* peer_ready[kMaxRanks] = {};  // rank p's ready_in: announce `seq` in its slot `rank`
  const uint32_t* ready_in = nullptr;    // this rank's ready_in (the peers' announcements)
};

// AG copy-engine path: side-stream helpers around cudaMemcpyAsync.
struct SideSync {
  Mailbox* mbox = nullptr;
  int32_t rank = 0, peer = 0;
  uint32_t seq = 0;
  uint64_t timeout_ns = 0;
  uint32_t* flags = nullptr;  // signal: the peer's flag words of our chunks
  int32_t count = 0;          // signal: number of flag words
  const uint32_t* counter = nullptr;  // wait also for *counter >= target (local; RS copy engine)
  uint32_t target = 0;
  const uint32_t* ready_local = nullptr;  // our ready_in slot of `peer` (null: host word only)
  uint64_t* tl = nullptr;     // kTlSide words or null
};

// AG push: copy this rank's x rows into every peer's gather buffer.
struct PushLaunch {
  const void* x = nullptr;  // [m, k]
  int32_t m = 0, row_bytes = 0, rank = 0, nranks = 1;
  uint32_t* counters = nullptr;  // local [P-1][m tiles] piece arrival counters (zeroed once)
  const uint32_t* ready_in = nullptr;  // our ready_in (the peers' announcements) or null
  Mailbox* mbox = nullptr;
  uint32_t seq = 0;
  uint64_t timeout_ns = 0;
  int32_t grid = 0;
};

}  // namespace dfccl::overlap
