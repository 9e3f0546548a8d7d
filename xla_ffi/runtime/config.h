// GPU runtime configuration: the entries of jax_dfccl.config this runtime
// reads, under the same names and units.  Their defaults and meaning live in
// jax_dfccl/config.py only: the fields here have none (zero until set),
// `_dfccl_cuda.configure(dict)` sets the entries given (unknown ones belong to
// other backends), and Runtime::Start refuses to run before every entry was set
// once (jax_dfccl._src.backend.load passes them all).  A value outside the
// runtime's range is rejected (dfccl::Error, ValueError in Python), never
// clamped, so config() reports exactly what Python set.  Pool geometry
// (small_*, large_*, direct_slots, direct) applies to communicators created later.
//
// Spin budgets are nanoseconds of %globaltimer on the device (device/wait.cuh
// Spinner), so no SM clock rate is assumed anywhere.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>

#include "dfccl/check.h"

namespace dfccl::gpu {

// (type, name) of every entry; the order is the set_mask bit order.
#define DFCCL_GPU_CONFIG(X)                  \
  X(double, timeout_s)                       \
  X(double, spin_budget_us)                  \
  X(double, sticky_budget_us)                \
  X(double, idle_quit_us)                    \
  X(double, stall_quit_us)                   \
  X(int, max_blocks)                         \
  X(int64_t, copy_engine_min_bytes)          \
  X(int64_t, copy_engine_reduce_min_bytes)   \
  X(int64_t, copy_engine_chunk_bytes)        \
  X(int, copy_engine_blocks)                 \
  X(bool, copy_engine_push)                  \
  X(bool, trace)                             \
  X(double, relaunch_max_us)                 \
  X(int64_t, lane_min_bytes)                 \
  X(int, small_slots)                        \
  X(int, small_lanes)                        \
  X(int64_t, small_chunk)                    \
  X(bool, ll)                                \
  X(bool, small_by_identity)                 \
  X(bool, direct)                            \
  X(int, large_slots)                        \
  X(int, direct_slots)                       \
  X(int, large_lanes)                        \
  X(int, large_depth)                        \
  X(int64_t, large_chunk)                    \
  X(int, large_max_blocks)                   \
  X(int64_t, large_threshold)                \
  X(double, submit_inline_us)                \
  X(bool, submit_pdl)

inline constexpr int kMaxDaemonBlocks = 64;  // control block included (kMaxBlocks in device/task.h)

struct Config {
#define DFCCL_GPU_CONFIG_FIELD(T, name) T name{};
  DFCCL_GPU_CONFIG(DFCCL_GPU_CONFIG_FIELD)
#undef DFCCL_GPU_CONFIG_FIELD
  bool configured = false;  // every entry set at least once
  uint64_t set_mask = 0;

  // Derived values (nothing here is a second default).
  int workers() const { return max_blocks - 1; }  // worker blocks; one more is the control block
  int large_workers() const { return std::max(large_max_blocks, max_blocks) - 1; }
  int64_t spin_ns() const { return static_cast<int64_t>(spin_budget_us * 1e3); }
  // A lane whose peer keeps delivering spins up to spin_ns << sticky_max: the
  // largest doubling of spin_budget_us that stays within sticky_budget_us.
  int sticky_max() const {
    const double ratio = sticky_budget_us / spin_budget_us;
    int s = 0;
    while (s < 16 && static_cast<double>(int64_t{1} << (s + 1)) <= ratio) ++s;
    return s;
  }
  int64_t idle_ns() const { return static_cast<int64_t>(idle_quit_us * 1e3); }
  int64_t stall_ns() const { return static_cast<int64_t>(stall_quit_us * 1e3); }
  int64_t inline_ns() const { return static_cast<int64_t>(submit_inline_us * 1e3); }

  // The range of each entry; empty if `v` is valid for `name`.
  static std::string Invalid(const std::string& name, double v) {
    auto in = [&](double lo, double hi) { return v >= lo && v <= hi; };
    const bool integral = v == static_cast<double>(static_cast<int64_t>(v));
    if (name == "timeout_s" || name == "spin_budget_us" || name == "idle_quit_us" || name == "stall_quit_us" ||
        name == "relaunch_max_us")
      return v > 0 ? "" : "> 0";
    if (name == "sticky_budget_us") return v > 0 ? "" : "> 0";
    if (name == "max_blocks" || name == "large_max_blocks") return in(2, kMaxDaemonBlocks) && integral ? "" : "2..64";
    if (name == "small_lanes" || name == "large_lanes") return in(1, 64) && integral ? "" : "1..64";
    if (name == "small_chunk" || name == "large_chunk")
      return v >= 16 && integral && static_cast<int64_t>(v) % 16 == 0 ? "" : "a multiple of 16";
    if (name == "copy_engine_chunk_bytes") return v >= (1 << 16) && integral ? "" : ">= 65536";
    if (name == "copy_engine_blocks" || name == "small_slots" || name == "large_slots" || name == "direct_slots" ||
        name == "large_depth" || name == "lane_min_bytes")
      return v >= 1 && integral ? "" : ">= 1";
    if (name == "copy_engine_min_bytes" || name == "copy_engine_reduce_min_bytes")
      return v >= -1 && integral ? "" : ">= -1";
    if (name == "large_threshold") return v >= 0 && integral ? "" : ">= 0";
    if (name == "submit_inline_us") return v >= 0 ? "" : ">= 0";
    return "";  // bools
  }

  // Sets the entries of kv this runtime reads; all or none (throws
  // dfccl::Error kInvalidArgument naming the entry and its range).
  void Apply(const std::map<std::string, double>& kv) {
    for (const auto& [name, v] : kv) {
      const std::string why = Invalid(name, v);
      DFCCL_CHECK(why.empty(), "dfccl: config entry " << name << " = " << v << " is out of range for the GPU "
                                                      << "runtime (" << why << ")");
    }
    uint64_t bit = 1;
#define DFCCL_GPU_CONFIG_SET(T, name)                    \
  if (auto it = kv.find(#name); it != kv.end()) {        \
    name = static_cast<T>(it->second);                   \
    set_mask |= bit;                                     \
  }                                                      \
  bit <<= 1;
    DFCCL_GPU_CONFIG(DFCCL_GPU_CONFIG_SET)
#undef DFCCL_GPU_CONFIG_SET
    configured = set_mask == bit - 1;
  }

  // Every entry's value (module function config()).
  template <class F>
  void ForEach(F&& f) const {
#define DFCCL_GPU_CONFIG_VISIT(T, name) f(#name, name);
    DFCCL_GPU_CONFIG(DFCCL_GPU_CONFIG_VISIT)
#undef DFCCL_GPU_CONFIG_VISIT
  }
};

}  // namespace dfccl::gpu
