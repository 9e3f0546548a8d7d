// The submit side of a collective on XLA's stream (protocol: device/task.h,
// "submit", "inline" and "done"), shared by the one-thread submit kernel
// (device/submit_kernel.cu) and the inline submit kernel (device/daemon_kernel.cu,
// which has the lane functions): take the task's sequence number and ticket,
// arrive at its instance, publish it, wait for its done word.
#pragma once

#include <cstddef>

#include "device/match.cuh"
#include "device/primitives.cuh"
#include "device/wait.cuh"

namespace dfccl::gpu {

inline constexpr int64_t kSubmitLockBudgetNs = 20000;  // a busy bucket: leave the arrival to the control warp

// The ring entry's done word has reached generation g (ld.acquire.sys): the
// predicate of the done waits, under device/wait.cuh's DoneWordWait.
DFCCL_DEV auto DoneWordReached(const DeviceShared* dev, uint32_t e, uint32_t g) {
  return [=] { return static_cast<int32_t>(LdAcquireSys(&dev->done[e]) - g) >= 0; };
}

// With tracing on: the submit kernel's own event ev of ticket d.ticket, at time t_ns.
DFCCL_DEV void StreamStamp(DeviceShared* dev, const TaskDesc& d, TraceEvent ev, uint64_t t_ns) {
  dev->stream_trace[d.ticket % kTaskRing][ev - kEvStreamWait] =
      TraceRec{t_ns, d.key_hash, d.ticket, static_cast<uint32_t>(d.seq), ev, 0};
}

// Waits until done[e] reaches gen; then a failed task traps when asked to
// (no handler runs inside a command buffer to report it).
DFCCL_DEV void WaitDone(DeviceShared* dev, uint64_t ticket, int trap, int trace, int64_t timeout_ns) {
  const uint32_t e = ticket % kTaskRing, g = Gen(ticket);
  TraceRec proto{0, 0, ticket, 0, 0, 0};
  if (trace) {
    proto.key_hash = LdVol(&dev->desc[e].key_hash);
    proto.seq = static_cast<uint32_t>(LdVol(&dev->desc[e].seq));
    proto.t_ns = GlobalTimer();
    proto.event = kEvStreamWait;
    dev->stream_trace[e][kEvStreamWait - kEvStreamWait] = proto;
  }
  SpinWaitOrTrap<DoneWordWait>(DoneWordReached(dev, e, g), static_cast<uint64_t>(timeout_ns), NoAbort{}, [&](WaitEnd) {
    printf("dfccl: done wait of ticket %llu gave up after %lld ns (daemon gone?)\n",
           static_cast<unsigned long long>(ticket), static_cast<long long>(timeout_ns));
  });
  if (trace) {
    proto.t_ns = GlobalTimer();
    proto.event = kEvStreamWoke;
    dev->stream_trace[e][kEvStreamWoke - kEvStreamWait] = proto;
  }
  if (trap && LdVol(&dev->status[e]) != kStatusOk) {
    printf("dfccl: collective (key hash %llx, sequence %llu) failed with status %u; the error names it on the host\n",
           static_cast<unsigned long long>(LdVol(&dev->desc[e].key_hash)),
           static_cast<unsigned long long>(LdVol(&dev->desc[e].seq)), LdVol(&dev->status[e]));
    __trap();
  }
}

// One thread: the task of call site p.site with this call's buffers and its
// sequence number (an identity task also its slot and tag); no ticket yet.  Reads
// no memory the stream's earlier kernels write (it may run before
// GridDependencyWait): the static task is a kernel parameter.
DFCCL_DEV void SubmitTake(const SubmitParams& p, TaskDesc& d) {
  DeviceShared* dev = p.dev;
  const uint64_t seq = atomicAdd(&dev->seq_ctr[p.task.key_ctr], 1ull);
  d = p.task;
  d.ticket = 0;
  d.seq = seq;
  if (d.direct) d.direct |= p.tags;
  d.in = p.in;
  d.out = p.out;
  if (d.match == kMatchIdentity) {  // (the site's slot is the key's bucket)
    d.epoch = IdentityTag(d.key_hash, seq);
  } else {  // a table entry or (protocol "announce") a receive slot, once matched
    d.slot = -1;
    d.epoch = 0;
    if (d.match != kMatchAnnounce) d.match = -1;
  }
  const bool aligned = (reinterpret_cast<uintptr_t>(p.in) % 16 == 0) && (reinterpret_cast<uintptr_t>(p.out) % 16 == 0);
  d.vec = d.vec && aligned;
  d.invalid = d.pool == 0 && !aligned ? PackStatus(kStatusUnaligned, d.rank, d.rank) : 0u;  // the LL path needs 16-byte lines
  d.run = p.run;
  d.tomb = 0;
}

// One thread, after GridDependencyWait (the stage kernel's words are written): a
// start form's task takes its call's slot (protocol "staged" in device/task.h),
// and fails when the stage kernel found the slot held.  Returns the call number.
DFCCL_DEV uint64_t SubmitStage(const SubmitParams& p, TaskDesc& d) {
  const StageView& s = p.stage;
  const uint64_t c = LdVol(&s.state->calls);
  const int k = static_cast<int>(c % kStageSlots);
  d.in = s.slot[k];
  d.out = s.slot[k] + s.out_off;
  d.vec = p.task.vec;  // the slots are 256-byte aligned
  if (d.direct) d.direct = p.task.direct | s.tags[k];
  d.invalid = LdVol(&s.state->skipped) == c + 1 ? PackStatus(kStatusStageBusy, d.rank, d.rank) : 0u;
  return c;
}

// One thread, once task d has its ticket: the slot's owner (a task that failed
// for want of it owns nothing) and the site's call count.
DFCCL_DEV void SubmitStageOwner(const SubmitParams& p, const TaskDesc& d, uint64_t call) {
  SiteStage* st = p.stage.state;
  const int k = static_cast<int>(call % kStageSlots);
  if (!d.invalid) StVol(&st->owner_ticket[k], d.ticket + 1);
  StVol(&st->calls, call + 1);
}

// One thread: a ticket for task d, once its ring entry's previous ticket is complete
// and the control warp has finished its announcement handle (protocol "announce":
// TaskRun::ann is set before the task can complete and cleared after; the entry
// is not reused while it is held, or its receive slot would never be released).
DFCCL_DEV void SubmitTicket(const SubmitParams& p, TaskDesc& d) {
  DeviceShared* dev = p.dev;
  const uint64_t t = atomicAdd(&dev->next_ticket, 1ull);
  const uint32_t e = t % kTaskRing, g = Gen(t);
  const auto reached = DoneWordReached(dev, e, g - 1);
  const TaskRun* prev = &dev->run[e];
  if (t >= kTaskRing)  // the entry's previous ticket
    SpinWaitOrTrap<DoneWordWait>([=] { return reached() && LdVol(&prev->ann) == 0; }, static_cast<uint64_t>(p.timeout_ns), NoAbort{},
                                 [&](WaitEnd) {
                                   printf("dfccl: more than %d collectives in flight on one GPU for %lld ns\n",
                                          kTaskRing, static_cast<long long>(p.timeout_ns));
                                 });
  d.ticket = t;
}

// One thread: the ring entry's run state (its previous ticket is complete); its
// lane states are zeroed unless the caller writes them.
DFCCL_DEV void SubmitRun(const SubmitParams& p, const TaskDesc& d, const TaskRun& run, bool zero_lanes) {
  DeviceShared* dev = p.dev;
  const uint32_t e = d.ticket % kTaskRing;
  for (int l = 0; zero_lanes && l < d.lanes && l < kMaxLanes; ++l) {
    StVolVec(&dev->lane[e][l], make_uint4(0, 0, 0, 0));
    StVolVec(reinterpret_cast<uint4*>(&dev->lane[e][l]) + 1, make_uint4(0, 0, 0, 0));
  }
  StVolVec(&dev->run[e], *reinterpret_cast<const uint4*>(&run));
  StVolVec(reinterpret_cast<uint4*>(&dev->run[e]) + 1, *(reinterpret_cast<const uint4*>(&run) + 1));
}

// One thread: task `run` fails with status `why` (written before the flag the
// workers and the control warp read).
DFCCL_DEV void AbortRun(TaskRun* run, uint32_t why) {
  StVol(&run->status, why);
  __threadfence();
  StVol(&run->aborted, 1);
}

// One thread, after SubmitTake: the ticket, the first match attempt (an identity
// task is matched already), the entry's run and lane state reset.  Returns the
// match result (MatchResult); the task is not published yet.
DFCCL_DEV int SubmitMatch(const SubmitParams& p, TaskDesc& d) {
  SubmitTicket(p, d);
  // Arrive at the instance now (the common case: a slot is free), so the daemon
  // can run the task as soon as it ingests it; a task left without a slot (or
  // whose bucket lock was busy) is brought on by the control warp.
  uint32_t why = 0;
  int r;
  if (d.match == kMatchIdentity) {  // (a tombstone's lanes run: they tell the receivers, protocol "run")
    r = d.invalid && !d.tomb ? kMatchFailed : kMatchSlotted;
    why = d.invalid;
  } else if (d.match == kMatchAnnounce) {  // the control warp starts it in its Announcer (protocol "announce")
    r = kMatchRetry;
  } else {
    r = d.invalid ? kMatchRetry : Arrive(d, &d, 0u, &why, kSubmitLockBudgetNs);
  }
  TaskRun run{0, 0, r == kMatchSlotted ? 2 : r == kMatchArrived ? 1 : 0, 0, 0, 0};
  if (r == kMatchFailed) { run.aborted = 1; run.status = why; }
  if (r == kMatchSlotted) run.t_check = GlobalTimer();
  SubmitRun(p, d, run, true);
  return r;
}

// One thread: the descriptor into the ring and pub[e] (release: the descriptor,
// and the run and lane state written before, are complete when pub is seen), the
// host's record, the start form's ticket.
DFCCL_DEV void SubmitPublish(const SubmitParams& p, const TaskDesc& d) {
  DeviceShared* dev = p.dev;
  const uint32_t e = d.ticket % kTaskRing, g = Gen(d.ticket);
  const uint4* src = reinterpret_cast<const uint4*>(&d);
  uint4* dst = reinterpret_cast<uint4*>(&dev->desc[e]);
#pragma unroll
  for (int i = 0; i < kDescWords; ++i) StVolVec(dst + i, src[i]);
  StReleaseGpu(&dev->pub[e], g);
  // The host's record, one 16-byte store (the proxy reads gen, then the rest):
  // it relaunches a daemon that quit and runs the watchdog.
  SubRec rec{d.seq, p.site | (d.tomb ? kTombSite : 0), g};
  StVolVec(&p.host->sub[e], *reinterpret_cast<const uint4*>(&rec));
  if (p.ticket_out && !d.tomb) *p.ticket_out = static_cast<int64_t>(d.ticket);
}

// One thread, a start's tombstones (protocol "run" in device/task.h): they take
// the start's sequence number and n - 1 more, the start the next one (on one
// stream no other start of the key takes one meanwhile: the next submit kernel
// runs once this one completed).
DFCCL_DEV void SubmitTombstones(const SubmitParams& p, TaskDesc& d, int64_t n) {
  const uint64_t more = atomicAdd(&p.dev->seq_ctr[p.task.key_ctr], static_cast<unsigned long long>(n));
  for (int64_t i = 0; i < n; ++i) {
    TaskDesc t = p.task;  // no buffers, no launch id; it arrives failed
    t.ticket = 0;
    t.seq = i == 0 ? d.seq : more + static_cast<uint64_t>(i - 1);
    t.in = nullptr;
    t.out = nullptr;
    if (t.match == kMatchIdentity) {
      t.epoch = IdentityTag(t.key_hash, t.seq);
    } else {
      t.slot = -1;
      t.epoch = 0;
      if (t.match != kMatchAnnounce) t.match = -1;
    }
    t.run = 0;
    t.tomb = 1;
    t.invalid = PackStatus(kStatusLeftBehind, t.rank, t.rank);
    SubmitMatch(p, t);
    SubmitPublish(p, t);
  }
  d.seq = more + static_cast<uint64_t>(n - 1);
  if (d.match == kMatchIdentity) d.epoch = IdentityTag(d.key_hash, d.seq);
}

// A start's program line as it was before the start (protocol "run"), read by
// SubmitBookRead after GridDependencyWait: the stream's earlier kernels are then
// complete and their stores visible (with programmatic launch too), so no writer
// of the line or of run_word fences for it (a fence per start would stall the
// thread that makes it, which the lanes' barriers wait for).  Reading it before
// the dependency wait where the kernel starts after the previous one anyway (in
// flight with SubmitTake's atomic) measured slower, not faster (H100:
// benchmarks/results/keep_2026-12-07_h100_mps_bookread.json).  The host writes
// a line only before the execution's thunks run.
struct BookRead {
  uint4 w[3];
  int64_t owed;
  uint32_t word;
};

// One thread, after GridDependencyWait.
DFCCL_DEV BookRead SubmitBookRead(const SubmitParams& p) {
  BookRead b;
  DeviceShared* dev = p.dev;
  const int line = p.book - 1;
  static_assert(sizeof(RunSlot) == 48 && offsetof(RunSlot, taken) == 40, "RunSlot: three 16-byte words");
  const uint4* g = reinterpret_cast<const uint4*>(&dev->run_slot[line]);
  b.w[0] = LdVolVec(g);
  b.w[1] = LdVolVec(g + 1);
  b.w[2] = LdVolVec(g + 2);
  b.owed = LdVol(&dev->run_owed[line]);
  b.word = p.run != 0 ? p.run : LdVol(&dev->run_word);
  return b;
}

// One thread, after SubmitTake and GridDependencyWait, a start of a group spanning
// processes (p.book > 0; protocol "run" in device/task.h): the execution's launch
// id into the task (the handler's, or inside a command buffer the initialize
// stage's word), the start counted in its program's line (as SubmitBookRead read
// it; the line to store into *out), and the tombstones the line asks for
// submitted before it.  Returns true when more were owed than one start submits
// (the rest stays owed; the caller fails this start's task, which would pair
// with a left-behind run).
DFCCL_DEV bool SubmitBookPlan(const SubmitParams& p, TaskDesc& d, const BookRead& b, RunSlot* out) {
  RunSlot& s = *out;
  reinterpret_cast<uint4*>(&s)[0] = b.w[0];
  reinterpret_cast<uint4*>(&s)[1] = b.w[1];
  reinterpret_cast<uint4*>(&s)[2] = b.w[2];
  const uint32_t run = b.word;
  int64_t n = RunSlotStart(s, b.owed, run);
  const bool behind = n > kMaxTombstones;
  if (behind) {
    s.taken -= n - kMaxTombstones;
    n = kMaxTombstones;
  }
  d.run = run;
  if (n > 0) SubmitTombstones(p, d, n);
  return behind;
}

// Any thread: the line SubmitBookPlan made, into the book (the kernel's end makes
// it visible to the stream's next submit kernel).
DFCCL_DEV void SubmitBookStore(const SubmitParams& p, const RunSlot& s) {
  uint4* g = reinterpret_cast<uint4*>(&p.dev->run_slot[p.book - 1]);
  StVolVec(g, reinterpret_cast<const uint4*>(&s)[0]);
  StVolVec(g + 1, reinterpret_cast<const uint4*>(&s)[1]);
  StVolVec(g + 2, reinterpret_cast<const uint4*>(&s)[2]);
}

// One thread: SubmitBookPlan and SubmitBookStore.
DFCCL_DEV bool SubmitBook(const SubmitParams& p, TaskDesc& d, const BookRead& b) {
  alignas(16) RunSlot s;
  const bool behind = SubmitBookPlan(p, d, b, &s);
  SubmitBookStore(p, s);
  return behind;
}

}  // namespace dfccl::gpu
