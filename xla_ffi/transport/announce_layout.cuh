// The formats of protocol C (transport/announce.cuh): the 64-byte record, this
// rank's state (table entries, tasks, slots), and Layout, the one struct that
// computes every offset of a rank's region from the geometry, so that offsets are
// equal on every rank (the transport's symmetric region).  Compiled by g++ and nvcc.
#pragma once

#include <cstdint>

#include "device/task.h"
#include "transport/transport.cuh"

namespace dfccl::gpu::ann {

inline constexpr int kMaxRanks = kTransportMaxRanks;
inline constexpr int kMaxSlots = 256;
inline constexpr int kMaxEntries = 4096;
inline constexpr uint32_t kNoSlot = 0xffffffffu;

enum RecordKind : uint16_t { kRecAnnounce = 1, kRecSlot = 2, kRecVerdict = 3, kRecGrant = 4 };

// One announcement (or a slot update, a verdict, a grant), put whole with a
// strong signal add on the member's per-sender ring counter, so "counter reached
// n" implies record n is readable.  valid = epoch << 32 | n (n: the record's
// 1-based count on this sender's ring at the member, low 32 bits); never reset,
// so a record of an earlier lap never passes for the new one.
struct alignas(64) Record {
  uint32_t group;       // group index (equal on every rank)
  uint16_t rank;        // the sender's rank in the group
  uint16_t kind;        // RecordKind
  uint64_t key;         // key hash
  uint64_t seq;         // sequence number of (group, key)
  uint64_t sig;         // signature hash (announce)
  uint32_t slot_off;    // receive slot: region offset of its section 0, kNoSlot: none yet
  uint32_t slot_bytes;  // bytes per source section (the message size)
  uint32_t epoch;       // the slot's generation (announce, slot); the grant's number (grant)
  uint32_t status;      // verdict: PackStatus of the failure; announce, slot: the announcer's
                        // failure, i.e. no slot will follow
  uint64_t ranks;       // verdict: the ranks it names (missing, dead, disagreeing)
  uint64_t valid;
};
static_assert(sizeof(Record) == 64, "an announcement is one 64-byte line");

struct Geometry {
  int nranks;           // N
  int depth;            // K: records in flight per (sender, member) ring
  int entries;          // match table entries (>= N x tasks + tombstones)
  int tasks;            // I: this rank's instances in flight (the cap)
  int slots;            // receive slots (the last one the reserve)
  uint32_t slot_bytes;  // bytes per source section of a slot (multiple of 16)
};

// This rank's instance (one per started instance until Finish).
enum TaskState : int32_t { kFree = 0, kRunning = 1, kReady = 2, kFailed = 3 };
struct Task {
  uint64_t key, seq, sig;
  const char* src;  // this rank's message (read until the task is ready)
  uint32_t bytes;
  int32_t state;    // TaskState
  int32_t slot;     // receive slot, -1: none yet
  uint32_t status;  // kFailed: PackStatus of the failure
  uint64_t ranks;   // kFailed: the ranks it names
  uint64_t start_ns;
};

enum EntryFlags : uint32_t { kStarted = 1, kFinished = 2, kVerdict = 4 };
struct Entry {
  uint64_t id;           // MatchId(key, seq); 0: free
  uint64_t key, seq;
  uint64_t arrived;      // members whose announcement is in (this rank's own: at Start)
  uint64_t slotted;      // members whose slot is known (each owed one put)
  uint64_t closed;       // members whose slot is known or will never come (no record of theirs can follow)
  uint64_t sent;         // members this rank made its one put to
  uint64_t queued;       // members whose put is in the caller's outbox (Announcer::Sent moves it to sent)
  uint64_t told;         // members this rank announced to
  uint64_t told_slot;    // ... with its slot, or that none will come
  uint64_t ranks;        // failure: the ranks it names
  uint64_t todo;         // home: members still owed the verdict or the grant
  uint64_t seen_ns;      // first seen here (the home's deadline counts from it)
  uint32_t status;       // failure (PackStatus), 0: none
  uint32_t flags;        // EntryFlags
  uint32_t grant;        // the home's grant number, 0: none
  int32_t task;          // this rank's task, -1: none
};
struct Peer {            // a member's announcement of an entry
  uint64_t sig;
  uint32_t slot_off, bytes;
};
struct Slot {
  uint64_t expect;       // members told this slot: each owes one put
  uint32_t epoch;        // generation, counts claims
  int32_t busy;          // a task holds it
};
struct State {
  uint64_t sent[kMaxRanks];      // records put to each member
  uint64_t consumed[kMaxRanks];  // records drained from each member
  uint64_t seen[kMaxRanks];      // each member's ring counter as a pass polled it (drained up to it)
  uint64_t acked[kMaxRanks];     // each member's acknowledgement as last read (credits: sent - acked)
  uint64_t acked_out[kMaxRanks]; // what this rank last acknowledged to each member
  uint64_t free_bits[kMaxSlots / 64];
  uint64_t closing[kMaxSlots / 64];     // slots given up by their task, not free yet (puts still owed)
  uint64_t occupied[kMaxEntries / 64];  // table entries in use (a pass visits only these)
  uint64_t grant_open;           // home: the outstanding grant's id, 0: none
  uint32_t grants;               // home: grants made
  int32_t live_entries;
};

// Byte offsets of everything, equal on every rank (the transport's symmetric region).
struct Layout {
  Geometry g;
  uint64_t ring, ring_sig, ack, slot, slot_sig;  // written by peers
  uint64_t state, entry, peer, task, slot_state, slot_base, stage, bytes;

  DFCCL_TASK_HD static uint64_t Up(uint64_t x) { return (x + 63) / 64 * 64; }
  DFCCL_TASK_HD static Layout Of(const Geometry& g) {
    Layout l{};
    const uint64_t n = static_cast<uint64_t>(g.nranks);
    l.g = g;
    uint64_t o = 0;
    l.ring = o;       o = Up(o + n * g.depth * sizeof(Record));      // [src][K]
    l.ring_sig = o;   o = Up(o + n * 8);                             // [src]
    l.ack = o;        o = Up(o + n * 8);                             // [member]: what it consumed of ours
    l.slot = o;       o = Up(o + static_cast<uint64_t>(g.slots) * n * g.slot_bytes);  // [slot][src][bytes]
    l.slot_sig = o;   o = Up(o + static_cast<uint64_t>(g.slots) * n * 8);             // [slot][src]
    l.state = o;      o = Up(o + sizeof(State));
    l.entry = o;      o = Up(o + static_cast<uint64_t>(g.entries) * sizeof(Entry));
    l.peer = o;       o = Up(o + static_cast<uint64_t>(g.entries) * n * sizeof(Peer));
    l.task = o;       o = Up(o + static_cast<uint64_t>(g.tasks) * sizeof(Task));
    l.slot_state = o; o = Up(o + static_cast<uint64_t>(g.slots) * sizeof(Slot));
    l.slot_base = o;  o = Up(o + static_cast<uint64_t>(g.slots) * n * 8);
    l.stage = o;      o = Up(o + static_cast<uint64_t>(g.tasks) * g.slot_bytes);  // [task][bytes]: a put's source, staged
    l.bytes = o;
    return l;
  }
  // (depth and the slots' stride divided as 32-bit or masked: a 64-bit division is a
  // long subroutine on the GPU, and these are on every pass)
  DFCCL_TASK_HD uint64_t RingAt(int src, uint64_t i) const {
    const uint32_t d = static_cast<uint32_t>(g.depth);
    const uint64_t k = (d & (d - 1)) == 0 ? (i & (d - 1)) : i % d;
    return ring + (src * static_cast<uint64_t>(d) + k) * sizeof(Record);
  }
  DFCCL_TASK_HD uint64_t RingSig(int src) const { return ring_sig + src * 8ull; }
  DFCCL_TASK_HD uint64_t Ack(int member) const { return ack + member * 8ull; }
  DFCCL_TASK_HD uint64_t SlotAt(int s) const { return slot + static_cast<uint64_t>(s) * g.nranks * g.slot_bytes; }
  DFCCL_TASK_HD uint64_t SlotData(int s, int src) const { return SlotAt(s) + static_cast<uint64_t>(src) * g.slot_bytes; }
  DFCCL_TASK_HD uint64_t SlotSig(int s, int src) const { return slot_sig + (static_cast<uint64_t>(s) * g.nranks + src) * 8; }
  // This rank's own state, [state, state + OwnBytes()): read and written by the
  // rank's protocol thread alone (no peer puts there, the host never reads it), so
  // it may live elsewhere while a daemon runs (Announcer's `own`).
  DFCCL_TASK_HD uint64_t OwnBytes() const { return stage - state; }
  DFCCL_TASK_HD uint64_t StageAt(int task) const { return stage + static_cast<uint64_t>(task) * g.slot_bytes; }
  DFCCL_TASK_HD int SlotOf(uint32_t slot_off) const {  // (a slot's offset is 32-bit: Record::slot_off)
    return static_cast<int>((slot_off - static_cast<uint32_t>(slot)) / (static_cast<uint32_t>(g.nranks) * g.slot_bytes));
  }
};

// A message put the Announcer leaves to its caller (Progress with an outbox): the
// daemon's control warp ships it with all its lanes (Transport::PutWarp) after the
// pass, asking Ship first whether it is still data or became a release, then Sent.
struct PutJob {
  uint64_t id;          // the entry (MatchId)
  const char* src;      // this rank's message
  uint64_t dst_off;     // the member's receive section for this rank
  uint64_t sig_off;     // its signal word
  uint64_t stage_off;   // the task's staging section in this rank's region (Transport::PutWarp)
  const void* tag;      // the caller's (the daemon: the communicator's view)
  uint32_t bytes;
  int32_t peer;
};
struct Outbox {
  static constexpr int kMax = 16;  // full: the rest wait for a later pass
  int n;                           // (no initialisers: the daemon's is in shared memory)
  PutJob job[kMax];
};

struct Config {
  uint32_t group = 0;
  uint64_t timeout_ns = 0;  // a task's deadline, and the home's per instance
  uint64_t grace_ns = 0;    // past its deadline, a rank waits this long for the verdict
  uint64_t flush_ns = 0;    // the bound of the flush before a task is ready
  // The communicator's generation: every rank's reset() advances it alike, and the
  // daemon keys its instances by it (AnnounceKey), so an entry of an earlier
  // generation (a tombstone, a record still in flight) never meets a new instance.
  uint64_t generation = 0;
};

// The key an instance of the daemon goes by in a generation (generation 0: the key).
DFCCL_TASK_HD uint64_t AnnounceKey(uint64_t key_hash, uint64_t generation) {
  return key_hash ^ (generation * 0x9e3779b97f4a7c15ull);
}

}  // namespace dfccl::gpu::ann
