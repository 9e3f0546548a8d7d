// NVSHMEM as the engine under the cross-host transport (docs/design/scale-out.md
// §2.3, §5.1): its set-up from the host, and a check of the transport and of
// protocol C (transport/announce.cuh) over it, run by every PE at once.
//
// Set-up is NVSHMEM's unique-id bootstrap: PE 0 makes the id (UniqueId), the
// job's key-value store carries it (jax_dfccl/_src/nvshmem.py, through
// jax.distributed, as XLA's own NVSHMEM path does), every PE calls Init with it.
// Outside any execution, never inside a command buffer's recording.  One PE per
// process (and per GPU, apart from the one-GPU MPS testbed, where NVSHMEM runs
// several PEs on one GPU).
//
// Built only where NVSHMEM's headers and device library are found
// (CMakeLists.txt: the pip wheel nvidia-nvshmem-cu13 or NVSHMEM_HOME), as the
// module _dfccl_nvshmem; the rest of the extension loads without it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dfccl::nvshm {

// NVSHMEM's version as "major.minor.patch": the headers this module was built
// with, and the host library loaded (they must agree: Init refuses otherwise).
std::string BuiltVersion();
std::string LoadedVersion();

// PE 0's part of the bootstrap: the unique id, as bytes (128).
std::string UniqueId();
// Every PE: joins the job of `nranks` PEs as `rank` (nvshmemx_init_attr with the
// unique id); throws dfccl::Error naming what failed.  Returns the init status
// ("FULL_MPG", "LIMITED_MPG", "NOT_INITIALIZED", or "STATUS_n").
// device >= 0: that CUDA ordinal becomes this module's current device first (its
// PE's GPU; the module has a CUDA runtime of its own).
std::string Init(const std::string& uid, int rank, int nranks, int device = -1);
void Finalize();
bool Initialized();

// The daemon over NVSHMEM (nvshmem_daemon.cu): Heap makes the symmetric allocation
// its groups' regions are carved from (every PE at once, after Init; collective);
// DaemonEngineAddress is the module's gpu::DaemonEngine (device/daemon.h), which the
// CUDA runtime takes in place of its own (jax_dfccl/_src/nvshmem.py).  ReleaseHeap
// frees the allocation (collective; before Finalize).
void Heap(uint64_t bytes);
void ReleaseHeap();
uintptr_t DaemonEngineAddress();

// The check (every PE calls it with the same spec; collective).
struct CheckSpec {
  int blocks = 40;        // blocks of `per_block` instances, each block in rank-specific orders
  int per_block = 8;      // at most the cap (8)
  int msg_bytes = 64;     // each rank's message, a multiple of 8, at most 256
  int slots = 3;          // receive slots (fewer than per_block: the reserve is granted)
  int mismatch_every = 5; // every k-th instance has another signature on the last rank (0: none)
  int pingpong = 2000;    // round trips PE 0 <-> PE 1 (0: none)
  uint64_t seed = 1;
  double timeout_s = 10;  // the protocol's timeout (a deadlock shows as failures past it)
  bool store = true;      // also over StoreTransport on nvshmem_ptr's peer addresses, where every peer has one
  int ranks_per_host = 0; // a test setting: consecutive PEs form a "host" (0: one host) ...
  double delay_us = 0;    // ... and each put to another host waits this long first (DelayedTransport)
};
struct CheckRun {         // one transport's figures on this PE
  std::string transport;  // "nvshmem" or "store"
  std::string skipped;    // why it did not run ("" : it ran)
  int64_t ok = 0;         // instances whose sums equal the reference
  int64_t failed_as_expected = 0;  // mismatches failed with the status and ranks expected
  int64_t wrong = 0;      // sums that differ, or failures otherwise than expected
  bool cap_refused = false;  // the (I+1)-th start was refused at once (kStatusNoEntry)
  std::string first_error;   // the first wrong outcome, described
  double seconds = 0;        // the instances' phase
  std::vector<double> round_trip_us;  // PE 0: the ping-pong's round trips
};
std::vector<CheckRun> Check(const CheckSpec& spec);

// NVSHMEM's own collectives on a stream, the peer the library's are measured
// against (docs/design/scale-out.md §6): every PE calls it with the same spec
// (collective).  op: "psum" (nvshmemx_float_sum_reduce_on_stream), "all_gather"
// (fcollect) or "all_to_all" (alltoall), on NVSHMEM_TEAM_WORLD, float32; bytes:
// each PE's input (all_to_all: a multiple of 4 x PEs).  Each size is checked once
// against the exact reference, then timed: `iters` calls back to back on one
// stream between CUDA events, `reps` times.
struct NativeSpec {
  std::string op = "psum";
  std::vector<int64_t> bytes;
  int iters = 20;
  int reps = 5;
};
struct NativeRow {
  int64_t bytes = 0;
  bool exact = false;         // the first call's output equals the reference
  double max_err = 0;
  std::vector<double> us;     // per call, one figure per rep
};
std::vector<NativeRow> Native(const NativeSpec& spec);

}  // namespace dfccl::nvshm
