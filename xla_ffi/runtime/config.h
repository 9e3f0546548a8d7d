// GPU runtime configuration: every entry, its meaning and default, in one place.
// Applied by `_dfccl_cuda.configure(dict)` (unknown entries are ignored).  The
// user-facing names are jax_dfccl.config's (max_blocks, spin_budget_us,
// sticky_budget_us, idle_quit_us, stall_quit_us, timeout_s, trace); the rest are
// GPU-only tuning entries.  Pool geometry applies to communicators created later.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <type_traits>

namespace dfccl::gpu {

inline constexpr double kCyclesPerUs = 1980.0;  // H200 SM clock under load (spin budgets are in cycles)

struct Config {
  int blocks = 15;            // worker blocks of a daemon (SMs held while running: blocks + 1 control)
  int64_t spin_cycles = 4000; // base spin budget of a waiting lane before preemption (~2 us)
  int sticky_max = 4;         // a lane whose peer keeps delivering spins up to spin_cycles << sticky_max
  int64_t idle_us = 200;      // the daemon quits after this long with nothing pending (<= 1 ms)
  int64_t stall_us = 2000;    // ... or this long without progress while tasks are pending
  int64_t relaunch_max_us = 2000;  // proxy backoff cap for relaunching a stalled daemon
  double timeout_s = 60.0;    // watchdog: a collective pending this long fails with an error
  bool trace = false;         // record start/run/preempt/resume/finish events
  // Staging pools (per communicator, per rank, per source rank):
  int small_slots = 128;      // instances in flight with messages <= small_lanes * small_chunk
  int small_lanes = 16;
  int64_t small_chunk = 16384;     // LL lines: 8 KiB of data per lane
  int64_t lane_min_bytes = 4096;
  // LL protocol for pool 0 (flag-in-data lines, no fences); off: every message
  // uses pool 1's simple protocol.
  bool ll = true;  // a task uses ceil(bytes / lane_min_bytes) lanes at most
  // Direct path for pool-1 messages (one process): lanes read and write the
  // peers' XLA buffers in place (device/direct.cuh), no staging; off: staged
  // chunks through pool 1's ring (the protocol that does not need peers' addresses).
  bool direct = true;
  int large_slots = 16;       // instances in flight with larger messages (staged: each holds staging memory)
  int direct_slots = 256;     // ... on the direct path (flags and addresses only: a few KiB each)
  int large_lanes = 64;
  int large_depth = 2;
  int64_t large_chunk = 65536;
  // Bandwidth path: while a task with a per-peer message >= large_threshold is
  // pending, the daemon runs with large_blocks worker blocks (relaunched if needed).
  int large_blocks = 63;
  int64_t large_threshold = 4 << 20;
  // The done wait on XLA's stream: a stream memory wait (cuStreamWaitValue32),
  // or for messages of at least this many bytes a one-thread polling kernel
  // (wakes up promptly after long waits); -1: never the kernel.
  int64_t wait_kernel_bytes = 1 << 20;
  // Copy-engine path (runtime/copy_engine.h): collectives whose per-rank buffer
  // (the larger of input and output) has at least this many bytes are moved by
  // the copy engines, driven by a host thread, without the daemon; -1: never.
  // Reductions take it on 2-GPU groups only.
  int64_t copy_engine_min_bytes = 4 << 20;
  int64_t copy_engine_reduce_min_bytes = 64 << 20;  // ... and for reductions at least this many
  int64_t copy_engine_chunk_bytes = 8 << 20;  // pipelining unit of the reductions' combine
  int copy_engine_blocks = 32;                // blocks of the combine kernel
  bool copy_engine_push = true;               // each rank's engines write to its peers (else: read from them)

  void Apply(const std::map<std::string, double>& kv) {
    auto set = [&](const char* name, auto& field) {
      auto it = kv.find(name);
      if (it != kv.end()) field = static_cast<std::remove_reference_t<decltype(field)>>(it->second);
    };
    // jax_dfccl.config names
    if (auto it = kv.find("max_blocks"); it != kv.end()) blocks = static_cast<int>(it->second) - 1;
    if (auto it = kv.find("spin_budget_us"); it != kv.end()) spin_cycles = static_cast<int64_t>(it->second * kCyclesPerUs);
    if (auto it = kv.find("sticky_budget_us"); it != kv.end()) {
      const double ratio = it->second * kCyclesPerUs / static_cast<double>(spin_cycles > 0 ? spin_cycles : 1);
      sticky_max = 0;
      while (sticky_max < 16 && static_cast<double>(int64_t{1} << (sticky_max + 1)) <= ratio) ++sticky_max;
    }
    set("idle_quit_us", idle_us); set("stall_quit_us", stall_us);
    // GPU-only names
    set("blocks", blocks); set("lane_min_bytes", lane_min_bytes); set("ll", ll); set("direct", direct);
    set("spin_cycles", spin_cycles); set("sticky_max", sticky_max);
    set("idle_us", idle_us); set("stall_us", stall_us); set("relaunch_max_us", relaunch_max_us);
    set("timeout_s", timeout_s); set("trace", trace);
    set("small_slots", small_slots); set("small_lanes", small_lanes); set("small_chunk", small_chunk);
    set("large_slots", large_slots); set("direct_slots", direct_slots); set("large_lanes", large_lanes); set("large_depth", large_depth);
    set("large_chunk", large_chunk); set("large_blocks", large_blocks); set("large_threshold", large_threshold);
    set("wait_kernel_bytes", wait_kernel_bytes);
    set("copy_engine_min_bytes", copy_engine_min_bytes); set("copy_engine_reduce_min_bytes", copy_engine_reduce_min_bytes); set("copy_engine_chunk_bytes", copy_engine_chunk_bytes);
    set("copy_engine_blocks", copy_engine_blocks); set("copy_engine_push", copy_engine_push);
    if (copy_engine_chunk_bytes < (1 << 16)) copy_engine_chunk_bytes = 1 << 16;
    if (copy_engine_blocks < 1) copy_engine_blocks = 1;
    if (large_blocks < blocks) large_blocks = blocks;
    if (large_blocks > 63) large_blocks = 63;
    if (blocks < 1) blocks = 1;
    if (blocks > 63) blocks = 63;
    if (small_lanes > 64) small_lanes = 64;
    if (large_lanes > 64) large_lanes = 64;
    small_chunk = (small_chunk + 15) / 16 * 16;
    large_chunk = (large_chunk + 15) / 16 * 16;
  }
};

}  // namespace dfccl::gpu
