// The matching protocol of (group, key, sequence) instances over memory shared
// by several processes: one control segment per job (a table of instances,
// a process table, one lock), written once so that any process's threads (the
// CPU daemons today; a daemon over CUDA IPC memory later) run the very same
// protocol.  Data never goes through this table: each rank stages its input in
// its own process's arena (a second segment per process, mapped by every
// peer), and an instance's slot records where (process, offset).
//
// Everything in the segment is a plain struct of fixed size; pointers never
// are (each process maps the segment at its own address).
//
// Locking: every state transition of an entry, the index and the process table
// happens under Header::lock, a spin lock whose word holds the owner's pid: a
// waiter that finds the owner dead (kill -9 inside the critical section)
// takes the lock over.  Critical sections copy at most a few hundred bytes.
// Lock-free reads (the daemons' polls):
//   posted   stored with release after the slot was filled; posted == n
//            (acquire) makes every slot visible and is final: an entry is
//            failed only while posted < n (checked under the lock), so a ready
//            entry is never failed and its slots are immutable until freed.
//   state    kFailed is stored (release) after `error`; readers that see it
//            take the lock to copy the error and acknowledge.
//   gen      bumped when an entry is freed; (entry, gen) names one instance.
// Entry lifecycle (n ranks):
//   free --first arrival--> open --last post--> ready (posted == n)
//   ready: every rank reads the peers' staged inputs, then readers_done += 1;
//          the n-th reader frees the entry (gen += 1): staged inputs are
//          reclaimable by their owners once gen moved on.
//   open --mismatch / timeout / dead peer / abort / a peer in a later
//          execution of the same program (dfccl/execution.h)--> failed: nobody ever read
//          anything; posted ranks acknowledge the error, late arrivals get it
//          too; freed when all n arrived and every posted rank acknowledged
//          (so a posted rank always finds its error text).  An entry failed
//          because a rank died is never freed: the job is over.
// Staging reclaim (by the owning process): (entry, gen) moved on, or failed.
// Executions (dfccl/execution.h): a slot records the launch id of the
// execution that posted it.  A rank arriving from a later execution of the
// same program than a posted rank fails the entry for that execution
// (`stale_run`), is counted as arrived without posting, and moves on to the
// next sequence number (PostResult::skip); so does any later arrival from a
// later execution at an entry failed that way.  A rank arriving from an
// earlier execution than a posted rank fails without arriving
// (PostResult::undo: its sequence number is not consumed, so the execution its
// process runs next meets the posted ranks).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dfccl/check.h"
#include "dfccl/host.h"

namespace dfccl::shm {

constexpr int kMaxRanks = 32;
constexpr int kMaxProcs = 64;
constexpr int kKeyLen = 128;
constexpr int kSigLen = 64;
constexpr int kErrLen = 640;
constexpr uint64_t kMagic = 0x6466636361766d31ull;  // "dfccavm1"

using dfccl::ProcessAlive;  // dfccl/host.h

struct Lock {
  std::atomic<int32_t> owner{0};  // pid of the holder, 0 when free
};
void Acquire(Lock& l);
void Release(Lock& l);

struct Slot {
  int32_t posted;
  int32_t proc;        // process whose arena holds the staged input
  int64_t offset;      // in that arena
  int64_t start_ns;    // steady clock (CLOCK_MONOTONIC: one clock per host)
  int64_t run;         // launch id of the posting execution (dfccl/execution.h)
  char sig[kSigLen];   // CollectiveSpec::Signature()
};

enum EntryState : uint32_t { kFree = 0, kOpen = 1, kFailed = 2 };

struct Entry {
  std::atomic<uint32_t> gen;
  std::atomic<uint32_t> state;
  uint64_t group_hash, key_hash;
  int64_t seq;
  int32_t n, arrived, acked, err_kind;  // err_kind: a dfccl::ErrorCode
  std::atomic<int32_t> posted;
  std::atomic<int32_t> readers_done;
  int32_t dead_cause;  // failed because a rank's process died: never freed
  int32_t has_stale_run;  // failed because its ranks' execution `stale_run` was left behind by a peer
  int64_t stale_run;
  int64_t devices[kMaxRanks];
  char key[kKeyLen];
  char error[kErrLen];
  Slot slots[kMaxRanks];
};

struct IndexCell {
  uint64_t group_hash, key_hash;
  int64_t seq;
  int32_t entry;
  int32_t state;  // 0 empty, 1 used, 2 tombstone
};

enum ProcState : int32_t { kProcNone = 0, kProcAlive = 1, kProcExited = 2 };

struct Proc {
  std::atomic<int32_t> pid;
  std::atomic<int32_t> state;
  std::atomic<uint32_t> bell;  // futex word: bumped when one of its ranks may progress
  int32_t pad;
};

struct Header {
  uint64_t magic;
  int32_t nprocs, entries, cells, tombstones, live, cursor;
  Lock lock;
  Proc procs[kMaxProcs];
};

// A process's view of the control segment at `base`.
class Table {
 public:
  static size_t Bytes(int entries);
  // Lays out an empty table (the creating process, before anyone maps it).
  static void Format(void* base, int nprocs, int entries);
  explicit Table(void* base);

  struct Post {
    uint64_t group_hash, key_hash;
    int64_t seq;
    int32_t n, rank, proc;
    const int64_t* devices;  // n global device ids, rank order
    std::string key, sig;
    int64_t offset, start_ns;
    int64_t run = 0;  // launch id of the execution (dfccl/execution.h)
  };
  struct PostResult {
    int32_t entry = -1;
    uint32_t gen = 0;
    bool ready = false;   // this post completed the instance
    bool failed = false;  // error set: this rank's task fails now
    bool skip = false;    // this rank left the entry's execution behind: arrive at the next sequence number
    bool undo = false;    // failed without arriving: the sequence number is not consumed
    int32_t err_kind = 0;  // a dfccl::ErrorCode
    std::string error;
  };
  PostResult Arrive(const Post& p);

  Entry& entry(int32_t e) { return entries_[e]; }
  // The entry of a posted rank has become ready (acquire).
  bool Ready(int32_t e) const { return entries_[e].posted.load(std::memory_order_acquire) == entries_[e].n; }
  int32_t Posted(int32_t e) const { return entries_[e].posted.load(std::memory_order_acquire); }
  // Polls a posted rank's entry for failure; on failure copies the error and
  // acknowledges it (once per call that returns true: call it until it does).
  bool TakeFailure(int32_t e, uint32_t gen, int32_t* kind, std::string* error);
  // Fails an open entry (posted < n) with error code `kind` (a dfccl::ErrorCode).  `missing_msg(entry)` builds the error
  // under the lock from the entry's slots ("" to leave it open).  Returns
  // false when it was ready, already failed or freed, or left open.
  template <typename F>
  bool FailOpen(int32_t e, uint32_t gen, int32_t kind, bool dead_cause, F&& missing_msg);
  // A rank finished reading the staged inputs; the n-th frees the entry.
  void ReleaseReader(int32_t e, uint32_t gen);
  // Whether staged inputs posted to (e, gen) may be reused by their owner.
  bool Reclaimable(int32_t e, uint32_t gen) const;

  Proc& proc(int32_t p) { return header_->procs[p]; }
  int32_t nprocs() const { return header_->nprocs; }
  void Ring(int32_t p);
  // Waits on process p's bell while it still reads `seen` (at most timeout_us).
  void WaitBell(int32_t p, uint32_t seen, int64_t timeout_us);

  // Copies of the live entries (under the lock), for reports.
  std::vector<std::unique_ptr<Entry>> Snapshot();
  // Frees failed entries and fails open ones holding a slot of process `proc`
  // (reset() of that process).  Returns the number of entries touched.
  int ResetProcess(int32_t proc, const std::string& msg);
  int32_t live();

 private:
  void FreeLocked(int32_t e);
  int32_t FindLocked(uint64_t g, uint64_t k, int64_t seq) const;
  int32_t InsertLocked(uint64_t g, uint64_t k, int64_t seq);
  void RebuildLocked();
  Header* header_;
  IndexCell* cells_;
  Entry* entries_;
};

template <typename F>
bool Table::FailOpen(int32_t e, uint32_t gen, int32_t kind, bool dead_cause, F&& missing_msg) {
  Entry& en = entries_[e];
  Acquire(header_->lock);
  bool open = en.gen.load(std::memory_order_relaxed) == gen &&
                    en.state.load(std::memory_order_relaxed) == kOpen &&
                    en.posted.load(std::memory_order_relaxed) < en.n;
  std::string msg;
  if (open) msg = missing_msg(static_cast<const Entry&>(en));
  open = open && !msg.empty();  // "": the reason went away under the lock
  if (open) {
    msg.resize(std::min<size_t>(msg.size(), kErrLen - 1));
    std::memcpy(en.error, msg.c_str(), msg.size() + 1);
    en.err_kind = kind;
    en.dead_cause = dead_cause;
    en.state.store(kFailed, std::memory_order_release);
  }
  Release(header_->lock);
  return open;
}

// POSIX shared-memory segments (names "/dfccl.<creator pid>.<token>.<what>").
void* CreateSegment(const std::string& name, size_t bytes);
void* OpenSegment(const std::string& name, size_t* bytes);
void UnlinkSegment(const std::string& name);
// Removes /dev/shm/dfccl.<pid>.* segments whose creating process is dead.
int SweepDeadSegments();

}  // namespace dfccl::shm
