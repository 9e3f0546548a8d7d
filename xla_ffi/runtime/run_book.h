// How many starts of one key an execution of this process left behind (protocol
// "run" in device/task.h; docs/design/execution_identity.md, "GPUs").
//
// On GPUs the sequence number of a start is taken on the device, so a process
// whose program failed before some starts of a key (a host callback raising,
// another op failing) is behind its peers on that key by exactly those starts.
// XLA calls the prepare stage of every start of a program once per execution,
// before any of its thunks runs (failed executions included), and the execute
// stage at every start outside command buffers, each with the launch id.  So per
// (device, key) this book knows each execution of a program that contains the
// key and counts its starts (the launch ids of one program are consecutive;
// CompareRuns tells a program's later execution from another program's).  When
// an execution begins, the program's previous one is over: what it did not
// start — the program's most starts of the key in one execution (`expected`;
// at least one per call site of the key, for a program that never finished
// one), less those it made, plus as many for every execution in between that
// was never seen — is owed, and the next start submits that many tombstones
// first.  Every process keeps the same books for the same programs
// (a legal program starts its collectives alike on every process), so where no
// process failed they all skip alike (a key some executions never start), and
// where one did, it alone skips what it missed.
//
// Pure C++ (no CUDA): tests/cpp/run_book_test.cc checks it on the CPU.  Not
// thread-safe (KeyRuns holds it under its mutex).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dfccl/execution.h"

namespace dfccl::gpu {

class RunBook {
 public:
  static constexpr size_t kPrograms = 16;  // programs remembered per key (the oldest goes first)

  // XLA's prepare stage of a start of the key (call site `site`) in execution
  // `run`: once per execution and site, before any of the execution's thunks
  // runs, failed executions included.  An execution that begins closes the
  // program's previous one: what that one did not start is owed.
  void Plan(uint32_t run, int64_t site) {
    Line& l = LineOf(run);
    RunLinePlan(l.r, run);
    if (std::find(l.site_ids.begin(), l.site_ids.end(), site) == l.site_ids.end()) {
      l.site_ids.push_back(site);
      l.r.sites = static_cast<int64_t>(l.site_ids.size());
    }
  }

  // A start of execution `run` recorded into a command buffer: XLA replays it
  // without calling the handler, so the program's starts go uncounted from now
  // on and the book asks nothing of it (docs/design/execution_identity.md).
  void Captured(uint32_t run) { LineOf(run).r.captured = 1; }

  // A start of the key by execution `run` (a launch id, not 0).  Returns the
  // starts the earlier executions of its program left behind (to submit as
  // tombstones before it).
  int64_t Start(uint32_t run) { return RunLineStart(LineOf(run).r, run); }

  // A start of the key found its instance taken by an execution of its peers
  // this process had left behind (the device's launch-id check failed it: it
  // was ahead): the execution it belongs with is one further on.
  void Owe(int64_t n) {
    if (!lines_.empty()) lines_.back().r.owed += n;
  }

 private:
  struct Line {
    RunLine r;                      // the arithmetic (dfccl/execution.h)
    std::vector<int64_t> site_ids;  // the program's call sites of the key
  };
  // The line of run's program (most recently used last); a new one if none.
  Line& LineOf(uint32_t run) {
    for (size_t i = 0; i < lines_.size(); ++i)
      if (CompareRuns(run, lines_[i].r.last) != RunOrder::kUnrelated) {
        std::rotate(lines_.begin() + static_cast<std::ptrdiff_t>(i),
                    lines_.begin() + static_cast<std::ptrdiff_t>(i) + 1, lines_.end());
        return lines_.back();
      }
    if (lines_.size() == kPrograms) lines_.erase(lines_.begin());
    Line l{};
    l.r.last = run;
    lines_.push_back(l);
    return lines_.back();
  }
  std::vector<Line> lines_;
};

}  // namespace dfccl::gpu
