// Protocol C of docs/design/scale-out.md §4: instance matching for communicators
// that span hosts, over a transport (transport/transport.cuh) that offers puts
// with a signal and nothing fetching.  docs/design/announce.md describes it as built.
//
// Every rank keeps its own match table.  A rank that starts an instance
// (group, key, sequence) puts a 64-byte announcement record into its mailbox ring
// at every member; each rank drains its mailboxes into its table without waiting
// on anything; an instance is matched on a rank once its table has every
// member's announcement.  The announcement carries the announcer's *receive
// slot* (claimed from its own bitmap), so a sender puts its data there as soon
// as it has the receiver's announcement.  Who decides what:
//  - a signature mismatch among all N announcements: every rank, alike (the
//    ranks whose signature differs from rank 0's, PackStatus(kStatusMismatch,
//    0, the lowest of them));
//  - a timeout (an announcement missing at the home's deadline, a mismatch
//    among the partial set included) and a dead rank: the *home* (rank 0 of the
//    group), which puts a verdict (key, sequence, status, ranks) to every member;
//    the verdict stays in each member's table as a tombstone that a late start
//    of the instance meets (it fails at once with the recorded error);
//  - a dead rank that the local task waits on (announcement or data): every
//    rank too, from the host's liveness mask (the home may be the dead one);
//  - a rank past its own deadline waits `grace_ns` more for the verdict, then
//    fails on its own naming the ranks it still waits on.
//
// Receive slots and why finite memory cannot deadlock a legal program:
//  - A sender puts data only into a slot its receiver announced, i.e. claimed for
//    an instance the receiver has started.  A sender makes exactly one put per
//    slot announced to it: the data, or a *release* (a signal alone, add 2) when
//    its instance failed; the receiver reuses a slot only once every member it
//    announced the slot to has put (or is dead), so a put of a failed instance
//    can never land in a later use of the slot.
//  - A rank that starts an instance with no free slot still announces that it
//    started (slot kNoSlot) and announces the slot in a second record once it has
//    one; no sender puts to it before that.  The last slot is the reserve, taken
//    only by an instance the home *granted*: one that every member has started
//    and that lacks a slot somewhere.  The home grants one instance at a time
//    (the next once its own task of the granted one is ready or failed) and every
//    rank serves grants in their order, so all ranks' reserves go to the same
//    instance, which completes without anyone starting anything else (a
//    reserve chosen by each rank alone could go to different instances, each
//    waiting on the other's reserve).
//  - Mailbox rings never stay full: the drain waits on nothing, and the table
//    it drains into cannot fill: every entry is an instance that some member has
//    in flight (at most N x I, with I = `tasks` per rank: Start refuses the
//    (I+1)-th with kStatusNoEntry, RESOURCE_EXHAUSTED, and never waits) or a
//    tombstone waiting for a late start.  Credits come back by PutValue.
//
// Memory: one region per rank (Layout, transport/announce_layout.cuh).  Peers
// write only the rings and their signal words, the acknowledgement words and the
// receive slots with their signal words; the rest is this rank's own state, read
// and written by one thread (the control warp's lane 0).  No STL, no virtual
// calls: the daemon includes this header as it is (tests/cpp/announce_stress.cc
// runs it on the host with threads as ranks).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "device/primitives.cuh"
#include "device/task.h"
#include "transport/announce_layout.cuh"
#include "transport/transport.cuh"

namespace dfccl::gpu::ann {

DFCCL_DEV int Lowest(uint64_t m) { return __ffsll(static_cast<long long>(m)) - 1; }  // -1: none

template <class Transport>
class Announcer {
 public:
  // `own`: where this rank's own state is (Layout::OwnBytes(): what no peer or host
  // reads), if not in the region: the daemon's control block keeps it in shared
  // memory (device/announce_path.cuh, AnnounceCache), because every acquire of a
  // pass (Acquire, Signal) invalidates the SM's L1 (CCTL.IVALL after the load or
  // fence), and a pass is a chain of dependent loads of this state.
  DFCCL_DEV Announcer(Transport& t, const Layout& l, const Config& c, char* own = nullptr) : t_(t), l_(l), c_(c) {
    me_ = t.Rank();
    n_ = l.g.nranks;
    all_ = n_ == 64 ? ~0ull : (1ull << n_) - 1;
    others_ = all_ & ~(1ull << me_);
    auto at = [&](uint64_t off) { return own ? own + (off - l.state) : t.Local(off); };
    st_ = reinterpret_cast<State*>(at(l.state));
    e_ = reinterpret_cast<Entry*>(at(l.entry));
    peer_ = reinterpret_cast<Peer*>(at(l.peer));
    task_ = reinterpret_cast<Task*>(at(l.task));
    slot_ = reinterpret_cast<Slot*>(at(l.slot_state));
    base_ = reinterpret_cast<uint64_t*>(at(l.slot_base));
  }

  // This rank's part of the region to its initial state.  Every rank's Init
  // happens before any peer's first put (the bootstrap's barrier); the words
  // peers write are zero in a fresh allocation and never reset.
  DFCCL_DEV void Init() {
    *st_ = State{};
    for (int s = 0; s < l_.g.slots; ++s) {
      st_->free_bits[s / 64] |= 1ull << (s % 64);
      slot_[s] = Slot{};
    }
    for (int i = 0; i < l_.g.entries; ++i) e_[i].id = 0;
    for (int i = 0; i < l_.g.tasks; ++i) task_[i].state = kFree;
  }

  // Message puts go to `ob` (the caller ships them after Progress: Ship, the put,
  // Sent) instead of this thread's Put; null: this thread puts them.
  DFCCL_DEV void SetOutbox(Outbox* ob, const void* tag) {
    ob_ = ob;
    tag_ = tag;
  }
  // What job j is now: 1, the data (its task still runs, no failure decided); 2, a
  // release (a signal alone: the instance failed since it was queued).
  DFCCL_DEV uint64_t Ship(const PutJob& j) {
    const Entry* e = Find(j.id);
    return e && !e->status && e->task >= 0 && task_[e->task].state == kRunning ? 1 : 2;
  }
  // Job j was put (or its member is dead): the entry's one put to it is made.
  DFCCL_DEV void Sent(const PutJob& j) {
    if (Entry* e = Find(j.id)) {
      e->sent |= 1ull << j.peer;
      e->queued &= ~(1ull << j.peer);
    }
  }

  // Starts this rank's instance; never waits.  Returns its task, or -1 with
  // *status: kStatusNoEntry (I instances in flight: the cap; or no table entry),
  // kStatusTwice.  A start that meets a tombstone returns a task already failed.
  DFCCL_DEV int Start(uint64_t key, uint64_t seq, uint64_t sig, const void* src, uint32_t bytes, uint32_t* status) {
    int h = -1;
    for (int i = 0; i < l_.g.tasks && h < 0; ++i)
      if (task_[i].state == kFree) h = i;
    const uint64_t now = GlobalTimer();
    // (A message larger than a slot's section is the host's to refuse at set-up.)
    Entry* e = h >= 0 && bytes <= l_.g.slot_bytes ? FindOrAdd(key, seq, now) : nullptr;
    if (e == nullptr) { *status = PackStatus(kStatusNoEntry, me_, me_); return -1; }
    if (e->flags & kStarted) { *status = PackStatus(kStatusTwice, me_, me_); return -1; }
    e->flags |= kStarted;
    e->arrived |= 1ull << me_;
    e->task = h;
    PeerOf(e, me_) = Peer{sig, kNoSlot, bytes};
    Task& k = task_[h];
    k = Task{key, seq, sig, static_cast<const char*>(src), bytes, kRunning, -1, 0, 0, now};
    if (e->status) FailTask(k, *e);  // a late arrival meets the tombstone
    *status = 0;
    return h;
  }

  DFCCL_DEV const Task& TaskOf(int h) const { return task_[h]; }
  // A ready task's message from `src` (its own: the task's source).
  DFCCL_DEV const char* Received(int h, int src) {
    const Task& k = task_[h];
    return src == me_ ? k.src : t_.Local(l_.SlotData(k.slot, src));
  }

  // This rank fails its running task h itself (its host aborted it: the deadline,
  // a peer process that exited): the instance fails here as on its own deadline
  // (members get a release, not data).  A task ready or failed already keeps its end.
  DFCCL_DEV void Abort(int h, uint32_t status) {
    Task& k = task_[h];
    if (k.state != kRunning) return;
    if (Entry* e = Find(MatchId(k.key, k.seq))) Fail(*e, status, 1ull << me_);
    else {
      k.state = kFailed;
      k.status = status;
      k.ranks = 1ull << me_;
    }
  }

  // The caller is done with a ready or failed task (its received data read).  A
  // failed one's puts may still read its staged source (a ready one's were flushed):
  // flushed before the task, and so its staging section, is free for the next.
  DFCCL_DEV void Finish(int h) {
    Task& k = task_[h];
    if (k.state != kReady) t_.Flush(c_.flush_ns);
    if (Entry* e = Find(MatchId(k.key, k.seq))) {
      e->flags |= kFinished;
      e->task = -1;
    }
    if (k.slot >= 0) {  // free once every expected put is in (Progress looks at the closing ones)
      slot_[k.slot].busy = 0;
      st_->closing[k.slot / 64] |= 1ull << (k.slot % 64);
    }
    k.state = kFree;
  }

  // One pass: drain the mailboxes, advance every entry, free slots.  Never waits.
  // Signal words are polled relaxed (a poll invalidates no cache line, so this
  // thread's own state stays in L1 through a pass that finds nothing new), and a
  // pass that acts on something a peer put acquires once (Transport::Acquire):
  // before it reads records, before a task is ready, before it reuses ring credits.
  DFCCL_DEV void Progress() {
    const uint64_t now = GlobalTimer(), dead = t_.DeadMask();
    uint64_t adv = 0;  // members with new records: their counters polled first, then one acquire
    for (int q = 0; q < n_; ++q) {
      if (q == me_) continue;
      const uint64_t c = t_.Poll(l_.RingSig(q));
      if (c != st_->consumed[q]) {
        st_->seen[q] = c;
        adv |= 1ull << q;
      }
    }
    if (adv) t_.Acquire();
    for (uint64_t m = adv; m; m &= m - 1) Drain(Lowest(m), now);
    uint32_t min_grant = 0;  // the grant the reserve serves next: the lowest one waiting for a slot here
    for (int i = Next(0); i < l_.g.entries; i = Next(i + 1)) {
      const Entry& e = e_[i];
      if (e.id && e.grant && !e.status && e.task >= 0 && task_[e.task].slot < 0 && (!min_grant || e.grant < min_grant))
        min_grant = e.grant;
    }
    for (int i = Next(0); i < l_.g.entries;) {
      if (Advance(e_[i], now, dead, min_grant)) {
        Erase(i);  // the entry moved into i (if any) is looked at next
        if (e_[i].id) continue;
      }
      i = Next(i + 1);
    }
    if (me_ == 0) Grant();
    for (int w = 0; w * 64 < l_.g.slots; ++w) {
      for (uint64_t c = st_->closing[w]; c; c &= c - 1) {
        const int s = w * 64 + Lowest(c);
        bool in = true;
        for (uint64_t m = slot_[s].expect & ~dead; m; m &= m - 1)
          if (t_.Poll(l_.SlotSig(s, Lowest(m))) == base_[s * n_ + Lowest(m)]) in = false;
        if (!in) continue;
        st_->free_bits[w] |= 1ull << (s % 64);
        st_->closing[w] &= ~(1ull << (s % 64));
      }
    }
  }

  // Nothing left: no entry, no task, every slot free, every mailbox drained.
  DFCCL_DEV bool Empty() {
    if (st_->live_entries != 0) return false;
    for (int i = 0; i < l_.g.tasks; ++i)
      if (task_[i].state != kFree) return false;
    for (int s = 0; s < l_.g.slots; ++s)
      if (!(st_->free_bits[s / 64] >> (s % 64) & 1ull)) return false;
    for (int q = 0; q < n_; ++q)
      if (q != me_ && t_.Signal(l_.RingSig(q)) != st_->consumed[q]) return false;
    return true;
  }

 private:
  DFCCL_DEV Peer& PeerOf(const Entry* e, int q) { return peer_[(e - e_) * n_ + q]; }
  DFCCL_DEV int Home(uint64_t id) const {  // (a mask where entries is a power of two: no 64-bit division)
    const uint32_t n = static_cast<uint32_t>(l_.g.entries);
    return static_cast<int>((n & (n - 1)) == 0 ? (id & (n - 1)) : id % n);
  }
  DFCCL_DEV int After(int j) const { return j + 1 == l_.g.entries ? 0 : j + 1; }
  // The first entry in use at or after i (entries: none).
  DFCCL_DEV int Next(int i) const {
    for (int w = i / 64; w * 64 < l_.g.entries; ++w) {
      uint64_t m = st_->occupied[w];
      if (w == i / 64) m &= ~0ull << (i % 64);
      if (m) return w * 64 + Lowest(m) < l_.g.entries ? w * 64 + Lowest(m) : l_.g.entries;
    }
    return l_.g.entries;
  }
  DFCCL_DEV void Occupy(int i, bool on) {
    if (on) st_->occupied[i / 64] |= 1ull << (i % 64);
    else st_->occupied[i / 64] &= ~(1ull << (i % 64));
  }

  // Open addressing, linear probing; deletion shifts back (no markers, so probes
  // stay as short as the load allows).
  DFCCL_DEV Entry* Find(uint64_t id) {
    for (int i = 0, j = Home(id); i < l_.g.entries; ++i, j = After(j)) {
      if (e_[j].id == id) return &e_[j];
      if (e_[j].id == 0) return nullptr;
    }
    return nullptr;
  }
  DFCCL_DEV Entry* FindOrAdd(uint64_t key, uint64_t seq, uint64_t now) {
    const uint64_t id = MatchId(key, seq);
    for (int i = 0, j = Home(id); i < l_.g.entries; ++i, j = After(j)) {
      if (e_[j].id == id) return &e_[j];
      if (e_[j].id != 0) continue;
      Entry& e = e_[j];
      e = Entry{};
      e.id = id;
      e.key = key;
      e.seq = seq;
      e.seen_ns = now;
      e.task = -1;
      for (int q = 0; q < n_; ++q) PeerOf(&e, q) = Peer{0, kNoSlot, 0};
      Occupy(j, true);
      st_->live_entries++;
      return &e;
    }
    return nullptr;  // full: the caller leaves the record in its ring for a later pass
  }
  DFCCL_DEV void Erase(int i) {
    for (int j = i;;) {
      j = After(j);
      if (e_[j].id == 0) break;
      const int k = Home(e_[j].id);
      if ((j > i && (k <= i || k > j)) || (j < i && k <= i && k > j)) {
        e_[i] = e_[j];
        for (int q = 0; q < n_; ++q) peer_[i * n_ + q] = peer_[j * n_ + q];
        i = j;
      }
    }
    e_[i].id = 0;
    Occupy(i, false);
    st_->live_entries--;
  }

  DFCCL_DEV void FailTask(Task& k, const Entry& e) {
    k.state = kFailed;
    k.status = e.status;
    k.ranks = e.ranks;
  }
  // The first decision of an entry wins; a task already complete keeps its result.
  DFCCL_DEV void Fail(Entry& e, uint32_t status, uint64_t ranks) {
    if (e.status || (e.task >= 0 && task_[e.task].state == kReady)) return;
    e.status = status;
    e.ranks = ranks;
    if (e.task >= 0 && task_[e.task].state == kRunning) FailTask(task_[e.task], e);
  }

  // A mismatch among the announcements in `among`: ranks whose signature differs
  // from the lowest one's (for all N: rank 0's, so every rank names it alike).
  DFCCL_DEV uint64_t Differ(const Entry& e, uint64_t among) {
    const uint64_t ref = PeerOf(&e, Lowest(among)).sig;
    uint64_t d = 0;
    for (uint64_t m = among; m; m &= m - 1)
      if (PeerOf(&e, Lowest(m)).sig != ref) d |= 1ull << Lowest(m);
    return d;
  }

  // Credits: the member's acknowledgement is read again only once the last value
  // read leaves none, and a new one is acquired (its reads of the ring happened
  // before this rank's puts reuse the records).
  DFCCL_DEV bool CanSend(int q) {
    const uint64_t depth = static_cast<uint64_t>(l_.g.depth);
    if (st_->sent[q] - st_->acked[q] < depth) return true;
    const uint64_t a = t_.Poll(l_.Ack(q));
    if (st_->sent[q] - a >= depth) return false;
    t_.Acquire();
    st_->acked[q] = a;
    return true;
  }
  // Puts r into q's ring from this rank; false: no credit (try on a later pass) or q dead.
  DFCCL_DEV bool Send(int q, Record& r) {
    if (!CanSend(q)) return false;
    r.group = c_.group;
    r.rank = static_cast<uint16_t>(me_);
    r.valid = static_cast<uint64_t>(r.epoch) << 32 | ((st_->sent[q] + 1) & 0xffffffffull);
    if (!t_.Put(q, l_.RingAt(me_, st_->sent[q]), &r, sizeof(r), l_.RingSig(me_), 1)) return false;
    st_->sent[q]++;
    return true;
  }

  // Applies q's records up to the counter the pass polled (and acquired) for it.
  // The acknowledgement goes back once half the ring is consumed since the last
  // one (a store and a fence less per record; a sender out of credits has at
  // least that many records consumed here, so it is always acknowledged).
  DFCCL_DEV void Drain(int q, uint64_t now) {
    const uint64_t c = st_->seen[q];
    while (st_->consumed[q] < c) {
      const uint64_t* w = reinterpret_cast<const uint64_t*>(t_.Local(l_.RingAt(q, st_->consumed[q])));
      uint64_t v[8];
      for (int i = 0; i < 8; ++i) v[i] = LdVol(w + i);  // past L1: a peer wrote it
      Record r;
      memcpy(&r, v, sizeof(r));
      if ((r.valid & 0xffffffffull) != ((st_->consumed[q] + 1) & 0xffffffffull) || r.group != c_.group ||
          r.rank != q)
        break;  // not this record (yet): a later pass
      if (!Apply(q, r, now)) break;
      st_->consumed[q]++;
    }
    if (st_->consumed[q] - st_->acked_out[q] >= static_cast<uint64_t>(l_.g.depth) / 2 &&
        t_.PutValue(q, l_.Ack(me_), st_->consumed[q]))
      st_->acked_out[q] = st_->consumed[q];
  }
  DFCCL_DEV bool Apply(int q, const Record& r, uint64_t now) {
    if (r.kind == kRecGrant) {  // only a rank still waiting for a slot needs it (it has the entry)
      if (Entry* e = Find(MatchId(r.key, r.seq))) e->grant = r.epoch;
      return true;
    }
    Entry* e = FindOrAdd(r.key, r.seq, now);
    if (e == nullptr) return false;
    const uint64_t bit = 1ull << q;
    switch (r.kind) {
      case kRecAnnounce:
        e->arrived |= bit;
        PeerOf(e, q).sig = r.sig;
        PeerOf(e, q).bytes = r.slot_bytes;
        if (r.slot_off == kNoSlot && r.status == 0) break;  // started; its slot follows
        [[fallthrough]];
      case kRecSlot:
        e->closed |= bit;
        if (r.slot_off != kNoSlot) {
          PeerOf(e, q).slot_off = r.slot_off;
          e->slotted |= bit;
        }
        break;
      case kRecVerdict:
        Fail(*e, r.status, r.ranks);
        e->flags |= kVerdict;
        break;
    }
    return true;
  }

  // Claims a receive slot for task k: an ordinary one, else the reserve when the
  // entry holds the grant the reserve serves next.  Reads each source's signal
  // word as the slot's base: every put of its previous use is in (or its sender dead).
  DFCCL_DEV void Claim(Entry& e, Task& k, uint32_t min_grant) {
    const int reserve = l_.g.slots - 1;
    int s = -1;
    for (int w = 0; w * 64 < reserve && s < 0; ++w) {
      uint64_t v = st_->free_bits[w];
      if (reserve - w * 64 < 64) v &= (1ull << (reserve - w * 64)) - 1;
      if (v) s = w * 64 + Lowest(v);
    }
    if (s < 0 && e.grant && e.grant == min_grant && (st_->free_bits[reserve / 64] >> (reserve % 64) & 1ull)) s = reserve;
    if (s < 0) return;
    st_->free_bits[s / 64] &= ~(1ull << (s % 64));
    slot_[s].expect = 0;
    slot_[s].epoch++;
    slot_[s].busy = 1;
    for (int q = 0; q < n_; ++q) base_[s * n_ + q] = t_.Poll(l_.SlotSig(s, q));
    k.slot = s;
  }

  // One entry's step; true: the entry is done with on this rank (erase it).
  DFCCL_DEV bool Advance(Entry& e, uint64_t now, uint64_t dead, uint32_t min_grant) {
    Task* k = e.task >= 0 ? &task_[e.task] : nullptr;
    const uint64_t missing = all_ & ~e.arrived;
    // Decisions.
    if (!e.status && !missing) {
      if (const uint64_t d = Differ(e, all_)) Fail(e, PackStatus(kStatusMismatch, 0, Lowest(d)), d);
    }
    if (!e.status && k && k->state == kRunning) {
      const uint64_t waiting = missing | Undelivered(e, *k);
      if (waiting & dead) Fail(e, PackStatus(kStatusFailedPeer, Lowest(waiting & dead), Lowest(waiting & dead)), waiting & dead);
      else if (now - k->start_ns > c_.timeout_ns + c_.grace_ns)
        Fail(e, PackStatus(kStatusAborted, waiting ? Lowest(waiting) : me_, me_), waiting);
    }
    if (me_ == 0 && !e.status && missing) {  // the home's verdicts
      if (missing & dead) Verdict(e, PackStatus(kStatusFailedPeer, Lowest(missing & dead), Lowest(missing & dead)), missing & dead);
      else if (now - e.seen_ns > c_.timeout_ns) {
        if (const uint64_t d = Differ(e, e.arrived)) Verdict(e, PackStatus(kStatusMismatch, Lowest(e.arrived), Lowest(d)), d);
        else Verdict(e, PackStatus(kStatusAborted, Lowest(missing), 0), missing);
      }
    }
    if (k && k->state == kRunning && k->slot < 0) Claim(e, *k, min_grant);
    // Announcements: that this rank started, with its slot once it has one, or
    // (its task over without one) that none will come.
    if (e.flags & kStarted) {
      const bool with_slot = k && k->state == kRunning && k->slot >= 0;
      const bool over = !k || k->state != kRunning;
      for (uint64_t m = others_ & ~e.told & ~dead; m; m &= m - 1) {
        const int q = Lowest(m);
        Record r{};
        r.kind = kRecAnnounce;
        r.key = e.key;
        r.seq = e.seq;
        r.sig = PeerOf(&e, me_).sig;
        r.slot_bytes = PeerOf(&e, me_).bytes;
        r.slot_off = with_slot ? static_cast<uint32_t>(l_.SlotAt(k->slot)) : kNoSlot;
        r.epoch = with_slot ? slot_[k->slot].epoch : 0;
        r.status = over ? e.status : 0;
        if (!Send(q, r)) continue;
        e.told |= 1ull << q;
        if (with_slot) Told(e, *k, q);
        else if (over) e.told_slot |= 1ull << q;
      }
      for (uint64_t m = with_slot || over ? e.told & ~e.told_slot & ~dead : 0; m; m &= m - 1) {
        const int q = Lowest(m);
        Record r{};
        r.kind = kRecSlot;
        r.key = e.key;
        r.seq = e.seq;
        r.slot_off = with_slot ? static_cast<uint32_t>(l_.SlotAt(k->slot)) : kNoSlot;
        r.epoch = with_slot ? slot_[k->slot].epoch : 0;
        r.status = over ? e.status : 0;
        if (!Send(q, r)) continue;
        if (with_slot) Told(e, *k, q);
        else e.told_slot |= 1ull << q;
      }
    }
    // The one put owed to each member whose slot is known: data, or a release.
    for (uint64_t m = e.slotted & ~e.sent & ~e.queued & others_; m; m &= m - 1) {
      const int q = Lowest(m);
      const Peer& p = PeerOf(&e, q);
      const int s = l_.SlotOf(p.slot_off);
      bool data = false;
      if (!e.status) {
        if (!k || k->state != kRunning) continue;  // not started here yet
        data = p.sig == k->sig && p.bytes == k->bytes;
      }
      if (data && ob_ && !(dead >> q & 1ull)) {  // the caller ships it (then Sent)
        if (ob_->n == Outbox::kMax) continue;
        ob_->job[ob_->n++] = PutJob{e.id, k->src, l_.SlotData(s, me_), l_.SlotSig(s, me_), l_.StageAt(e.task), tag_,
                                    k->bytes, q};
        e.queued |= 1ull << q;
        continue;
      }
      if (!(dead >> q & 1ull)) {
        const bool ok = data ? t_.Put(q, l_.SlotData(s, me_), k->src, k->bytes, l_.SlotSig(s, me_), 1)
                             : t_.Put(q, 0, nullptr, 0, l_.SlotSig(s, me_), 2);
        if (!ok && !(t_.DeadMask() >> q & 1ull)) continue;
      }
      e.sent |= 1ull << q;
    }
    // The home's verdict and grant to every member.
    for (uint64_t m = e.todo; m; m &= m - 1) {
      const int q = Lowest(m);
      Record r{};
      r.kind = (e.flags & kVerdict) ? kRecVerdict : kRecGrant;
      r.key = e.key;
      r.seq = e.seq;
      r.status = e.status;
      r.ranks = e.ranks;
      r.epoch = e.grant;
      if ((dead >> q & 1ull) || Send(q, r)) e.todo &= ~(1ull << q);
    }
    // This rank's task: ready once every member's data is in and its own is out.
    if (k && k->state == kRunning && !e.status && !missing && k->slot >= 0 && (e.sent & others_) == others_ &&
        !Undelivered(e, *k) && t_.Flush(c_.flush_ns)) {
      t_.Acquire();  // (the members' data, seen by polls, is read after this)
      k->state = kReady;
    }
    if (e.status && k && k->state == kRunning) FailTask(*k, e);
    // Done with here: this rank started and finished it, every live member has
    // announced it and closed its slot (no record of it can come any more), has
    // been told the same, and is owed nothing.
    const uint64_t live = others_ & ~dead;
    return (e.flags & kFinished) && !(missing & ~dead) && (e.closed & live) == live &&
           (e.told_slot & live) == live && !(e.slotted & ~e.sent & live) && !(e.todo & ~dead);
  }

  // Members whose data for k is not in its slot yet (all of them before it has one).
  DFCCL_DEV uint64_t Undelivered(const Entry&, const Task& k) {
    if (k.slot < 0) return others_;
    uint64_t u = 0;
    for (uint64_t m = others_; m; m &= m - 1) {
      const int q = Lowest(m);
      if (t_.Poll(l_.SlotSig(k.slot, q)) - base_[k.slot * n_ + q] != 1) u |= 1ull << q;  // 0: not yet; 2: released
    }
    return u;
  }
  DFCCL_DEV void Told(Entry& e, const Task& k, int q) {
    e.told_slot |= 1ull << q;
    slot_[k.slot].expect |= 1ull << q;
  }
  DFCCL_DEV void Verdict(Entry& e, uint32_t status, uint64_t ranks) {
    Fail(e, status, ranks);
    if (e.status != status) return;  // this rank's task had completed: nothing to tell
    e.flags |= kVerdict;
    e.todo = others_;
  }

  // The home grants the reserve to one instance at a time: one every member has
  // started, that lacks a slot somewhere; the next once its own task of the
  // granted one is ready or failed (or the entry is gone).
  DFCCL_DEV void Grant() {
    if (st_->grant_open) {
      const Entry* g = Find(st_->grant_open);
      if (g && !g->status && g->task >= 0 && task_[g->task].state == kRunning) return;
      st_->grant_open = 0;
    }
    for (int i = Next(0); i < l_.g.entries; i = Next(i + 1)) {
      Entry& e = e_[i];
      if (e.status || e.grant || e.arrived != all_ || e.task < 0 || task_[e.task].state != kRunning) continue;
      const bool slotless = (e.slotted & others_) != others_ || task_[e.task].slot < 0;
      if (!slotless || (e.todo & ~t_.DeadMask())) continue;
      e.grant = ++st_->grants;
      e.todo = others_;
      st_->grant_open = e.id;
      return;
    }
  }

  Transport& t_;
  Layout l_;
  Config c_;
  int me_, n_;
  uint64_t all_, others_;
  State* st_;
  Entry* e_;
  Peer* peer_;
  Task* task_;
  Slot* slot_;
  uint64_t* base_;
  Outbox* ob_ = nullptr;
  const void* tag_ = nullptr;
};

// The failure as the host names it: key, sequence, what, the ranks (host code).
inline int Describe(char* buf, int n, uint64_t key, uint64_t seq, uint32_t status, uint64_t ranks) {
  const char* what = "failed";
  switch (status & 0xff) {
    case kStatusMismatch: what = "ranks started it with different signatures (those differing from rank 0's)"; break;
    case kStatusFailedPeer: what = "ranks died (the host's liveness report)"; break;
    case kStatusAborted: what = "timed out waiting for ranks"; break;
    case kStatusNoEntry: what = "refused: the rank has its cap of instances in flight (RESOURCE_EXHAUSTED)"; break;
    case kStatusTwice: what = "started twice by a rank"; break;
  }
  int w = snprintf(buf, n, "collective key %llx seq %llu: %s:", static_cast<unsigned long long>(key),
                   static_cast<unsigned long long>(seq), what);
  for (uint64_t m = ranks; m && w < n; m &= m - 1) w += snprintf(buf + w, n - w, " %d", __builtin_ctzll(m));
  return w;
}

}  // namespace dfccl::gpu::ann
