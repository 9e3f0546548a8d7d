// The CPU backend across processes of one host.
//
// After jax_dfccl.initialize() (jax_dfccl/_src/distributed.py) every process
// maps one control segment (shm::Table: the instance table, the process table)
// and every process's staging arena.  A group whose devices all belong to this
// process keeps the in-process path of runtime.cc (peers' inputs read in
// place).  A group spanning processes takes this path, for all its ranks:
//   start  copies the rank's input into this process's arena (XLA's buffers of
//          another process are not addressable) and arrives at the shared entry
//          of (group, key, seq); the task goes to the device's daemon as usual.
//   daemon polls the entry (posted == n -> ready; failed -> the error), checks
//          the liveness of the processes of missing ranks (their pids in the
//          process table) every few ms and fails the entry naming a dead rank,
//          and enforces timeout_s with the same message as in one process.
//   compute reads every rank's staged input from its owner's arena, writes the
//          rank's own output, releases the entry; the task completes at once (its
//          XLA input was never shared).  The staged copy is reclaimed by its
//          owner once the entry moved on (every reader done) or failed.
// The last post (and every failure) wakes the poster's own daemons and rings
// the futex "bell" of each other process of the group; one thread per process
// waits on its bell and wakes its daemons.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpu/runtime.h"

namespace dfccl::cpu {

// A task's shared instance.
struct ShmRef {
  int32_t entry = -1;
  uint32_t gen = 0;
  int64_t next_check_ns = 0;  // next liveness check of the missing ranks' processes
};

// Whether the runtime spans processes and `spec`'s group has a rank in another one.
bool CrossProcess(const CollectiveSpec& spec);

// dfccl_start of a task whose group spans processes (runtime.cc built the
// task): counts its sequence number, stages and arrives (ShmStart), registers
// the ticket, submits it to the daemon or completes it with the error.
int64_t StartCrossProcess(const std::shared_ptr<Task>& task);
// Stages the input and arrives at the shared instance (task.seq is set).  On
// failure returns false with the error; else sets task.shm.
bool ShmStart(Task& task, ErrorCode* kind, std::string* error);
// Daemon hooks (task.shm set).
bool ShmReady(const Task& task);
int ShmPosted(const Task& task);
// Failure of the instance (mismatch seen by a peer, dead peer, abort): completes
// the task with the error and returns true.
bool ShmPoll(Task& task);
void ShmComputeAndRelease(Task& task);
void ShmFailOnTimeout(Task& task, double timeout_s);
// The device stopped after an error in `failed_key`: fails the open instance.
void ShmAbort(Task& task, const std::string& failed_key);
std::string ShmPendingReport();
void ShmReset();

struct ShmStats {
  bool attached = false;
  int64_t process = -1, processes = 0, live_entries = 0, staged_bytes = 0, arena_bytes = 0;
};
ShmStats GetShmStats();

// ---- bootstrap (driven by jax_dfccl/_src/distributed.py) -----------------------
// Creates and maps a segment of this process: the control segment (formatted
// for `nprocs` processes and `entries` instances) or this process's arena.
void ShmCreate(const std::string& name, int64_t bytes, bool control, int nprocs, int entries);
// Maps the other segments, registers this process (pid) and starts its bell
// thread.  device_procs: (global device id, process index) of every device.
void ShmAttach(const std::string& control, const std::vector<std::string>& arenas, int process,
               const std::vector<std::pair<int64_t, int32_t>>& device_procs);
// Marks this process as exited (peers waiting for its ranks fail at once).
void ShmDetach();
size_t ShmControlBytes(int entries);

}  // namespace dfccl::cpu
