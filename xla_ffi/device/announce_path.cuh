// Protocol "announce" in the daemon (device/task.h): groups spanning hosts are
// matched by protocol C (transport/announce.cuh, docs/design/announce.md), each
// rank with its own table in its region, instead of the home rank's match table.
//  - the control warp's lane 0 (AnnounceStep, from MatchPending) starts a task
//    in its communicator's Announcer, advances each announced communicator of the
//    pass once (the drain of the members' records, the puts of this rank's message
//    into their announced receive slots, the home's verdicts and grants), and
//    gives a task that is ready there its receive slot (epoch 1, then slot), so
//    the workers run its lanes; a failure there aborts the task with the
//    Announcer's status, the ranks it names in the top byte (AnnounceStatus);
//  - a lane (AnnounceLane) combines the members' messages, each whole in its
//    section of the slot, with the op's own Combine (the traits of
//    collectives/<op>.cuh: SendOffset says where a member's message holds this
//    rank's part), and waits on nothing;
//  - once the task is done, the control warp finishes its handle (the slot is
//    reused once every member's put to it is in).
// The transport is the peers' regions by pointer (NVLink, CUDA IPC); the same
// code runs over an engine's (transport/transport.cuh) once the daemon is built
// against one.
#pragma once

#include "device/announce_view.cuh"
#include "device/channel.cuh"
#include "device/submit.cuh"

namespace dfccl::gpu {

// An Announcer failure as a task status: PackStatus's code and two ranks, and
// the mask of every rank it names in the top byte (kMaxRanks = 8; none named:
// this rank), so it is never the bare kStatusAborted of the host's own aborts.
DFCCL_DEV uint32_t AnnounceStatus(const ann::Task& k, int rank) {
  const uint64_t ranks = (k.ranks & 0xffu) ? k.ranks : 1ull << rank;
  return (k.status & 0xffffffu) | (static_cast<uint32_t>(ranks & 0xffu) << 24);
}

// The own state (ann::Layout::OwnBytes: the table, tasks, slots and counters that
// only this rank's protocol thread reads) of the announced communicators this
// daemon advances, in the control block's shared memory while it runs.  A pass is
// a chain of dependent loads of that state, and every acquire it makes (of a
// peer's put) or the control warp makes (the ingest's fence) invalidates the SM's
// L1 (CCTL.IVALL), so in the region each of those loads went to L2.  Copied in at
// a communicator's first pass in this launch, written back before the daemon
// leaves (ControlLoop), so the next daemon, a later kernel, finds it in the region;
// nothing else reads it meanwhile (the host never does; its set-up writes only a
// new communicator's).  No room (kBytes): that communicator's stays in its region.
struct AnnounceCache {
  static constexpr int kMax = 4;
  static constexpr uint32_t kBytes = 32u << 10;  // the daemon's dynamic shared memory (LaunchDaemon)
  const AnnounceView* view[kMax];
  uint32_t at[kMax];
  int n;
  uint32_t used;
  char* mem;  // kBytes of the control block's dynamic shared memory
  DFCCL_DEV void Init(char* m) {
    mem = m;
    n = 0;
    used = 0;
  }
  // Lane 0: v's own state here (copied in at its first use), or null.
  DFCCL_DEV char* Of(const AnnounceView* v) {
    for (int i = 0; i < n; ++i)
      if (view[i] == v) return mem + at[i];
    const uint32_t b = static_cast<uint32_t>(v->l.OwnBytes());  // (a multiple of 64: Layout::Up)
    if (n == kMax || b > kBytes - used) return nullptr;
    const uint4* src = reinterpret_cast<const uint4*>(const_cast<DaemonTransport&>(v->t).Local(v->l.state));
    uint4* dst = reinterpret_cast<uint4*>(mem + used);
    for (uint32_t i = 0; i < b / 16; ++i) dst[i] = __ldcg(src + i);
    view[n] = v;
    at[n] = used;
    used += b;
    return mem + at[n++];
  }
  // Lane 0, before the daemon leaves: each own state back to its region.
  DFCCL_DEV void WriteBack() {
    for (int i = 0; i < n; ++i) {
      const AnnounceView* v = view[i];
      uint4* dst = reinterpret_cast<uint4*>(const_cast<DaemonTransport&>(v->t).Local(v->l.state));
      const uint4* src = reinterpret_cast<const uint4*>(mem + at[i]);
      for (uint32_t k = 0; k < static_cast<uint32_t>(v->l.OwnBytes()) / 16; ++k) dst[k] = src[k];
    }
    n = 0;
    used = 0;
    __threadfence();
  }
};

// The communicators the control warp advanced in this pass (each once), and the
// messages they left to ship (the outbox: in shared memory, ShipOutbox empties it).
struct AnnouncePass {
  static constexpr int kMax = 4;
  ann::Outbox* ob;
  AnnounceCache* cache;
  const AnnounceView* seen[kMax];
  int n = 0;
  DFCCL_DEV AnnouncePass(ann::Outbox* o, AnnounceCache* c) : ob(o), cache(c) {}
  DFCCL_DEV DaemonAnnouncer Of(const AnnounceView* v) { return AnnouncerOf(v, cache->Of(v)); }
  DFCCL_DEV void Progress(const AnnounceView* v, DaemonAnnouncer& a) {
    for (int i = 0; i < n; ++i)
      if (seen[i] == v) return;
    if (n < kMax) seen[n++] = v;  // (more communicators than that: advanced on every visit)
    a.SetOutbox(ob, v);
    a.Progress();
    a.SetOutbox(nullptr, nullptr);
  }
  DFCCL_DEV void Progress(const AnnounceView* v) {
    DaemonAnnouncer a = Of(v);
    Progress(v, a);
  }
};

// Lane 0 of the control warp, a pending (not done, not aborted) task of an
// announced communicator: start it, advance, and hand it to the lanes or fail it.
DFCCL_DEV void AnnounceStep(TaskRun* run, TaskDesc* dd, const TaskDesc& d, bool host_abort, AnnouncePass& pass) {
  const AnnounceView* v = d.comm->ann;
  DaemonAnnouncer an = pass.Of(v);
  uint64_t h1 = LdVol(&run->ann);
  if (h1 == 0) {
    if (d.invalid && !d.tomb) { AbortRun(run, d.invalid); return; }
    if (host_abort) { AbortRun(run, kStatusAborted); return; }
    uint32_t status = 0;
    const uint64_t key = ann::AnnounceKey(d.key_hash, LdVol(&v->c.generation));
    const int h = an.Start(key, d.seq, d.sig_hash, d.in, static_cast<uint32_t>(d.in_bytes), &status);
    if (h < 0) {
      AbortRun(run, status | (static_cast<uint32_t>(1u << d.rank) << 24));
      return;
    }
    // A tombstone (protocol "run") sends no data: its instance fails here at once,
    // so the members get a release (their tasks fail at their deadline, naming it).
    if (d.tomb) an.Abort(h, PackStatus(kStatusLeftBehind, d.rank, d.rank));
    h1 = static_cast<uint64_t>(h) + 1;
    StVol(&run->ann, h1);
    StVol(&run->phase, 1);
  }
  const int h = static_cast<int>(h1 - 1);
  if (host_abort) an.Abort(h, PackStatus(kStatusAborted, d.rank, d.rank));
  pass.Progress(v, an);
  const ann::Task& k = an.TaskOf(h);
  if (k.state == ann::kFailed) {
    AbortRun(run, host_abort ? static_cast<uint32_t>(kStatusAborted) : AnnounceStatus(k, d.rank));
  } else if (k.state == ann::kReady && LdVol(&run->phase) != 2) {
    StVol(&dd->epoch, 1u);  // (a worker runs a task once its slot and epoch are both set)
    __threadfence();
    StVol(&dd->slot, k.slot);
    StVol(&run->phase, 2);
  }
}

// The whole control warp, after the pass: each message the pass left in the
// outbox put by all 32 lanes (PutWarp), unless its instance failed meanwhile
// (then lane 0's release: a signal alone); then the entry's put counts as made.
// Lane 0 asks and records, so nothing between the question and the put can
// fail the task: only this warp does.  (A task is ready only once its puts are
// made, so its source, XLA's buffer, is still the task's while it is read.)
DFCCL_DEV void ShipOutbox(ann::Outbox* ob, AnnounceCache* cache, int lane) {
  const int n = *reinterpret_cast<volatile int*>(&ob->n);
  for (int i = 0; i < n; ++i) {
    const ann::PutJob j = ob->job[i];
    const AnnounceView* v = static_cast<const AnnounceView*>(j.tag);
    DaemonTransport& t = const_cast<DaemonTransport&>(v->t);
    const uint64_t add = __shfl_sync(0xffffffffu, lane == 0 ? AnnouncerOf(v, cache->Of(v)).Ship(j) : 0ull, 0);  // (lane 0's table)
    if (add == 1) t.PutWarp(lane, j.peer, j.dst_off, j.src, j.bytes, j.sig_off, 1, j.stage_off);
    else if (lane == 0) t.Put(j.peer, 0, nullptr, 0, j.sig_off, 2);
    if (lane == 0) AnnouncerOf(v, cache->Of(v)).Sent(j);
    __syncwarp();
  }
  __syncwarp();  // (every lane read n before lane 0 clears it)
  if (lane == 0) ob->n = 0;
  __syncwarp();
}

// Lane 0 of the control warp, a done task that holds a handle: release it.
DFCCL_DEV void AnnounceFinish(TaskRun* run, const TaskDesc* dd, AnnounceCache* cache) {
  const CommDev* cm = LdVol(&dd->comm);
  DaemonAnnouncer an = AnnouncerOf(cm->ann, cache->Of(cm->ann));
  an.Finish(static_cast<int>(LdVol(&run->ann) - 1));
  StVol(&run->ann, 0ull);
}

// A lane of a ready task: this rank's share [lane * lane_bytes, +lane_bytes) of
// the message, combined from the members' messages in this rank's receive slot.
template <class Op, class T, class R>
__device__ __noinline__ int AnnounceLane(const TaskDesc& d, LaneState&, int lane, const DaemonParams&) {
  const AnnounceView* v = d.comm->ann;
  const int me = d.rank;
  const int64_t off = lane * d.lane_bytes;
  const int64_t len = max(int64_t{0}, min(d.lane_bytes, d.msg_bytes - off));
  if (len > 0) {
    const char* own = const_cast<DaemonTransport&>(v->t).Local(0);  // (this rank's region)
    const char* src[kMaxRanks];
    for (int r = 0; r < d.nranks; ++r)
      src[r] = r == me ? d.in + Op::SelfOffset(d) + off : own + v->l.SlotData(d.slot, r) + Op::SendOffset(d, me) + off;
    Op::template Combine<T, R>(d, src, off, len);
  }
  __threadfence();  // the output is complete before the task's done word
  return kMoved | kDone;
}

}  // namespace dfccl::gpu
