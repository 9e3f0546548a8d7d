// Instance matching on the device: (group, key, sequence) -> one MatchEntry of
// the communicator's MatchTable, shared by all ranks (device memory of rank 0,
// reached over NVLink or CUDA IPC).  Called by one thread: the control warp's
// lane 0 (Arrive, ClaimSlot, Fail, CheckFailed) and a worker block's thread 0
// (Leave, when its task completes).  The protocol is written down in task.h
// ("match"); why a legal program does not deadlock on the table's finite
// resources, and the limit of that argument:
//  - entries: a rank that finds its bucket full does not wait — its task stays
//    unmatched and the next pass retries, so it never blocks a task that could
//    complete; a bucket holds kMatchWays live instances (4096 in the table).
//    The limit: a bucket's ways held by instances that some rank started ahead
//    of a peer which first waits on another instance of the same bucket (whose
//    entry cannot be created) would not come free; with instances hashed over
//    the buckets that takes hundreds started ahead, and the watchdog then says
//    that no rank arrived at it.
//  - slots: a slot is claimed by whichever rank's pass finds the entry without
//    one (so as soon as one rank started the instance: its data can move before
//    the others arrive) and freed by the last rank to complete; an instance
//    without a slot only waits, it holds nothing another instance needs.  But an
//    instance that some ranks started and others have not yet holds its slot
//    meanwhile, so a rank could start a pool's every slot's worth of instances
//    that a peer starts only after another instance of that pool completed, which
//    would then never get a slot.  Hence the reserve: a pool's last slot is taken
//    only by an instance every rank has arrived at.  Such an instance completes
//    without any rank starting anything else, so the reserve always comes free,
//    and every instance all ranks arrived at gets a slot in turn
//    (tests/cpp/match_stress.cc, DirectedSlots).
//  - the bucket lock (taken by Arrive and ClaimSlot; Leave needs none) guards
//    only short, non-blocking sections (no wait on a peer
//    inside); a holder that cannot finish is a dead process, which the host's
//    timeout reports.
#pragma once

#include "device/primitives.cuh"
#include "device/wait.cuh"
#include "dfccl/execution.h"

namespace dfccl::gpu {

// Outcome of an arrival or claim attempt.
enum MatchResult : int { kMatchRetry = 0, kMatchArrived = 1, kMatchSlotted = 2, kMatchFailed = 3 };

DFCCL_DEV MatchEntry* EntryOf(MatchTable* t, int match) {
  return &t->entry[match / kMatchWays][match % kMatchWays];
}

// The lock is an acquire CAS and a release store; everything written under it
// is ordered by them.  Scope: system when the table may be reached by another
// GPU (groups of more than one), else the GPU (a release at system scope costs
// ~0.5 us on an H200, at GPU scope ~0.14 us).
DFCCL_DEV uint32_t LockCas(MatchTable* t, int b, bool sys) {
  return sys ? CasAcquireSys(&t->lock[b], 0u, 1u) : CasAcquireGpu(&t->lock[b], 0u, 1u);
}

// Takes bucket b's lock, trying for up to budget_ns (device/wait.cuh LockWait);
// false: busy all along, the caller leaves the task for a later pass.
DFCCL_DEV bool LockBucket(MatchTable* t, int b, bool sys, int64_t budget_ns) {
  return SpinWait<LockWait>([&] { return LockCas(t, b, sys) == 0u; }, static_cast<uint64_t>(budget_ns)) ==
         WaitEnd::kReady;
}

DFCCL_DEV void UnlockBucket(MatchTable* t, int b, bool sys) {
  if (sys) StReleaseSys(&t->lock[b], 0u);
  else StReleaseGpu(&t->lock[b], 0u);
}

// Under the bucket lock: a free slot of `pool` for entry `m`, with its epoch
// (both into the entry).  Returns the slot and sets *epoch, or -1 if none is free.
// The pool's last slot is the reserve: only an instance every rank of the group
// has arrived at (`all_arrived`) may take it (see the top of this file).
DFCCL_DEV int32_t TakeSlot(MatchTable* t, volatile MatchEntry* m, int pool, int nslots, uint32_t* epoch,
                           bool all_arrived) {
  const int usable = all_arrived ? nslots : nslots - 1;
  for (int w = 0; w * 64 < usable; ++w) {
    const unsigned long long allowed = usable - w * 64 >= 64 ? ~0ull : (1ull << (usable - w * 64)) - 1ull;
    unsigned long long v = LdVol(&t->free_bits[pool][w]) & allowed;
    while (v != 0ull) {
      const int bit = __ffsll(static_cast<long long>(v)) - 1;
      const unsigned long long mask = 1ull << bit;
      const unsigned long long old = atomicAnd_system(&t->free_bits[pool][w], ~mask);
      if (old & mask) {
        const int slot = w * 64 + bit;
        *epoch = atomicAdd_system(&t->epoch[pool][slot], 1u) + 1u;
        m->epoch = *epoch;
        m->slot = slot;
        return slot;
      }
      v = old & ~mask & allowed;
    }
  }
  return -1;
}

// The instance's slot into the task: its copy d and the ring's descriptor dd
// (epoch first: a worker takes a slot only with its epoch).
DFCCL_DEV int SetSlot(TaskDesc& d, TaskDesc* dd, int32_t slot, uint32_t epoch) {
  d.epoch = epoch;
  d.slot = slot;
  StVol(&dd->epoch, epoch);
  __threadfence();
  StVol(&dd->slot, slot);
  return kMatchSlotted;
}

// The rank of task d arrives at its instance (first attempt).  `fail`: the task
// is aborted before it arrived — it arrives failed, so ranks that come later
// fail at once instead of waiting for it.  Sets d.match and, when a slot is
// known, d.epoch then d.slot (device copy, in that order).
DFCCL_DEV int Arrive(TaskDesc& d, TaskDesc* dd, uint32_t fail, uint32_t* status, int64_t budget_ns) {
  MatchTable* t = d.comm->table;
  const uint64_t id = MatchId(d.key_hash, d.seq);
  const int b = MatchBucket(id);
  const bool sys = d.nranks > 1;
  if (!LockBucket(t, b, sys, budget_ns)) return kMatchRetry;
  volatile MatchEntry* m = nullptr;
  bool created = false;
  uint64_t ids[kMatchWays];
#pragma unroll
  for (int w = 0; w < kMatchWays; ++w) ids[w] = LdVol(&t->entry[b][w].id);  // all loads in flight at once
  int way = -1, free_way = -1;
#pragma unroll
  for (int w = kMatchWays - 1; w >= 0; --w) {
    if (ids[w] == id) way = w;
    if (ids[w] == 0) free_way = w;
  }
  if (way < 0) {
    if (free_way < 0) { UnlockBucket(t, b, sys); return kMatchRetry; }
    way = free_way;
    m = &t->entry[b][way];
    m->key_hash = d.key_hash;
    m->seq = d.seq;
    m->sig = d.sig_hash;
    m->arrived = 0;
    m->done = 0;
    m->slot = -1;
    m->epoch = 0;
    m->failed = 0;
    m->first_rank = d.rank;
    m->pool = d.pool;
    m->run = d.run;
    m->id = id;  // readers of id hold the lock
    created = true;
  }
  m = &t->entry[b][way];
  const uint32_t bit = 1u << d.rank;
  // A new entry holds what was just stored (no round trip to read it back).
  const uint32_t m_failed = created ? 0u : m->failed, m_arrived = created ? 0u : m->arrived;  // loads issued together
  const uint64_t m_sig = created ? d.sig_hash : m->sig;
  const int32_t m_pool = created ? d.pool : m->pool, m_first = created ? d.rank : m->first_rank;
  int32_t slot = created ? -1 : m->slot;
  const uint32_t m_epoch = created ? 0u : m->epoch;  // the slot's, once it has one (set together, under the lock)
  const uint32_t m_run = created ? d.run : m->run;
  uint32_t failed = m_failed;
  if (!failed && (m_arrived & bit)) failed = PackStatus(kStatusTwice, d.rank, d.rank);
  if (!failed && (m_sig != d.sig_hash || m_pool != d.pool)) failed = PackStatus(kStatusMismatch, m_first, d.rank);
  if (!failed && fail) failed = fail;
  if (!failed && d.run != 0 && m_run != 0) {  // protocol "run": executions that do not belong together
    const RunOrder o = CompareRuns(d.run, m_run);  // the later run's process left the earlier one behind
    if (o == RunOrder::kLater) failed = PackStatus(kStatusLeftBehind, d.rank, m_first);
    if (o == RunOrder::kEarlier) failed = PackStatus(kStatusLeftBehind, m_first, d.rank);
  }
  if (m_run == 0 && d.run != 0) m->run = d.run;
  if (failed && !m_failed) m->failed = failed;
  m->arrived = m_arrived | bit;
  uint32_t epoch = m_epoch;
  if (!failed && slot < 0)
    slot = TakeSlot(t, m, d.pool, d.comm->pool[d.pool].nslots, &epoch, __popc(m_arrived | bit) == d.nranks);
  UnlockBucket(t, b, sys);
  d.match = b * kMatchWays + way;
  StVol(&dd->match, d.match);
  if (failed) { *status = failed; return kMatchFailed; }
  if (slot < 0) return kMatchArrived;
  return SetSlot(d, dd, slot, epoch);
}

// An arrived task whose instance had no free slot: try again.
DFCCL_DEV int ClaimSlot(TaskDesc& d, TaskDesc* dd, uint32_t* status, int64_t budget_ns) {
  MatchTable* t = d.comm->table;
  const int b = d.match / kMatchWays;
  volatile MatchEntry* m = EntryOf(t, d.match);
  const bool sys = d.nranks > 1;
  if (LdVol(&m->slot) < 0 && LdVol(&m->failed) == 0) {  // cheap look before taking the lock
    if (!LockBucket(t, b, sys, budget_ns)) return kMatchArrived;
    uint32_t epoch;  // read back below with the slot (another rank may have claimed it)
    if (m->slot < 0 && !m->failed)
      TakeSlot(t, m, d.pool, d.comm->pool[d.pool].nslots, &epoch, __popc(m->arrived) == d.nranks);
    UnlockBucket(t, b, sys);
  }
  const uint32_t failed = LdVol(&m->failed);
  if (failed) { *status = failed; return kMatchFailed; }
  const int32_t slot = LdAcquireSys(reinterpret_cast<const uint32_t*>(const_cast<int32_t*>(&m->slot)));
  if (slot < 0) return kMatchArrived;
  return SetSlot(d, dd, slot, LdVol(&m->epoch));
}

// The instance's failure state (0: none).
DFCCL_DEV uint32_t CheckFailed(const TaskDesc& d) {
  return LdVol(&EntryOf(d.comm->table, d.match)->failed);
}

// Fails the instance (first failure wins) so the other ranks abort it too.
DFCCL_DEV void Fail(const TaskDesc& d, uint32_t why) {
  atomicCAS_system(&EntryOf(d.comm->table, d.match)->failed, 0u, why);
}

// The rank's task of the instance completed (ok or aborted): the last of the
// group's ranks frees the slot and the entry.  task_slot / task_pool: the
// instance's slot and pool as the task got them (every rank gets the entry's one
// slot), or task_slot -1 when the task never got one (then read from the entry).
DFCCL_DEV void Leave(MatchTable* t, int match, int nranks, int32_t task_slot, int32_t task_pool) {
  if (match < 0) return;
  MatchEntry* m = EntryOf(t, match);
  const bool sys = nranks > 1;
  // acq_rel: this rank's use of the slot happens before the last rank frees it
  // (a group of one: nobody else counts).
  if (sys && AddAcqRelSys(&m->done, 1u) + 1u != static_cast<uint32_t>(nranks)) return;
  // Every rank has completed, so nobody else touches the entry and no rank
  // arrives at this instance again: no lock.  The slot goes back first, then
  // the entry, by its one store (a release of id = 0): an Arrive that finds the
  // way free (under its bucket's lock) writes every field anew.
  volatile MatchEntry* vm = m;
  const int32_t slot = task_slot >= 0 ? task_slot : vm->slot;
  if (slot >= 0) {
    const int32_t pool = task_slot >= 0 ? task_pool : vm->pool;
    atomicOr_system(&t->free_bits[pool][slot / 64], 1ull << (slot % 64));
  }
  uint64_t* id = const_cast<uint64_t*>(&vm->id);
  if (sys) StReleaseSys(id, 0ull);
  else StReleaseGpu(id, 0ull);
}

}  // namespace dfccl::gpu
