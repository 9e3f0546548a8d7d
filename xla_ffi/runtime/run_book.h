// The host's side of one key's execution book on one device (protocol "run" in
// device/task.h; docs/design/execution_identity.md, "GPUs").
//
// On GPUs the sequence number of a start is taken on the device, so a process
// whose program failed before some starts of a key (a host callback raising,
// another op failing) is behind its peers on that key by exactly those starts.
// The submit kernels count, per (device, key) and program, the starts of each
// execution in a device line (dfccl/execution.h RunLine, DeviceShared::run_slot),
// in stream order, inside XLA's command buffers too: the launch id of a replayed
// start is the one the initialize stage wrote for its execution
// (DeviceShared::run_word).  The first start of a later execution closes the
// earlier ones: what they did not start — the program's most starts of the key
// in one execution, at least one per call site — becomes tombstones.
//
// What the device cannot know the host tells it here, from XLA's initialize stage
// (called once per execution for every start of the program, before any of its
// thunks runs, failed executions included): which program an execution belongs
// to (the launch ids of one program are consecutive; CompareRuns), so each
// program gets its own line (a slot of the device's table), opened at the
// program's first execution with that launch id; and the program's call sites of
// the key (the least starts of an execution that never completed).  And, from
// the device's failures, starts owed beyond what the line counts (Owe: a start
// that found its instance taken by an execution this process had left behind).
//
// Every process keeps the same lines for the same programs (a legal program
// starts its collectives alike on every process), so where no process failed
// they all skip alike, and where one did, it alone skips what it missed.
//
// Pure C++ (no CUDA): tests/cpp/run_book_test.cc runs it with the device's
// arithmetic on the CPU.  Not thread-safe (KeyRuns holds it under its mutex).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "dfccl/execution.h"

namespace dfccl::gpu {

// The free slots of a device's table of lines (DeviceShared::run_slot).
class RunSlots {
 public:
  explicit RunSlots(int n) : n_(n) {}
  int Take() {  // -1: the table is full
    if (!free_.empty()) {
      const int s = free_.back();
      free_.pop_back();
      return s;
    }
    return next_ < n_ ? next_++ : -1;
  }
  void Give(int s) {
    if (s >= 0) free_.push_back(s);
  }

 private:
  int n_, next_ = 0;
  std::vector<int> free_;
};

class RunBook {
 public:
  static constexpr size_t kPrograms = 16;  // programs remembered per key (the oldest goes first)

  // What the device's line of a program must be told.
  struct Change {
    int slot = -1;        // the program's line (-1: none, the device's table is full)
    bool open = false;    // a new line: write it whole (last = the launch id, sites)
    bool sites = false;   // the call sites changed: write line.sites
    int freed = -1;       // an evicted program's slot, to give back
    RunSlot init{};       // the line to write
  };

  // XLA's initialize stage of a start of the key (call site `site`) in execution
  // `run`: once per execution and site, before any of the execution's thunks runs.
  // `slots`: where a new program's line comes from (may be null for a program
  // that has a line: SlotOf(run) >= 0).
  Change Plan(uint32_t run, int64_t site, RunSlots* slots) {
    Change ch;
    Line* l = Find(run);
    if (l == nullptr) {
      if (lines_.size() == kPrograms) {
        ch.freed = lines_.front().slot;
        lines_.erase(lines_.begin());
      }
      lines_.push_back(Line{});
      l = &lines_.back();
      l->last = run;
      l->slot = ch.freed >= 0 ? std::exchange(ch.freed, -1) : slots ? slots->Take() : -1;
      ch.open = l->slot >= 0;
    }
    if (CompareRuns(run, l->last) == RunOrder::kLater) l->last = run;
    if (std::find(l->site_ids.begin(), l->site_ids.end(), site) == l->site_ids.end()) {
      l->site_ids.push_back(site);
      ch.sites = l->slot >= 0;
    }
    ch.slot = l->slot;
    ch.init.line.last = run;
    ch.init.line.sites = static_cast<int64_t>(l->site_ids.size());
    if (ch.open) l->owed_total = 0;
    return ch;
  }

  // The line of execution `run`'s program (a start's handler, at recording or
  // outside command buffers); -1: none.
  int SlotOf(uint32_t run) {
    Line* l = Find(run);
    return l ? l->slot : -1;
  }

  // A start of the key found its instance taken by an execution of its peers
  // this process had left behind (it was ahead): the execution it belongs with
  // is one further on.  Returns the line of the latest program and its new total
  // of owed starts (to write to DeviceShared::run_owed), or slot -1.
  std::pair<int, int64_t> Owe(int64_t n) {
    if (lines_.empty() || lines_.back().slot < 0) return {-1, 0};
    lines_.back().owed_total += n;
    return {lines_.back().slot, lines_.back().owed_total};
  }

 private:
  struct Line {
    uint32_t last = 0;              // the program's latest execution the initialize stage saw
    int slot = -1;                  // its device line
    int64_t owed_total = 0;         // DeviceShared::run_owed[slot]
    std::vector<int64_t> site_ids;  // the program's call sites of the key
  };
  // The line of run's program, made the most recently used; null if none.
  Line* Find(uint32_t run) {
    for (size_t i = 0; i < lines_.size(); ++i)
      if (CompareRuns(run, lines_[i].last) != RunOrder::kUnrelated) {
        std::rotate(lines_.begin() + static_cast<std::ptrdiff_t>(i),
                    lines_.begin() + static_cast<std::ptrdiff_t>(i) + 1, lines_.end());
        return &lines_.back();
      }
    return nullptr;
  }
  std::vector<Line> lines_;
};

}  // namespace dfccl::gpu
