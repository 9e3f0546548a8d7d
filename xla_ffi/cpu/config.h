// CPU runtime configuration: the entries of jax_dfccl.config this runtime
// reads (the GPU runtime's counterpart is xla_ffi/runtime/config.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "dfccl/check.h"

namespace dfccl::cpu {

// The entries of jax_dfccl.config this runtime reads, (type, name), with the
// names and units of jax_dfccl/config.py, which alone holds their defaults and
// meaning.  configure() passes every entry; StartCollective refuses to run until
// each one was set once (no value here competes with Python's).
#define DFCCL_CPU_CONFIG(X)    \
  X(double, timeout_s)         \
  X(double, spin_budget_us)    \
  X(double, sticky_budget_us)  \
  X(bool, trace)               \
  X(int64_t, trace_capacity)   \
  X(int64_t, fault_device)     \
  X(double, fault_start_delay_us) \
  X(double, fault_compute_delay_us)

struct Config {
#define DFCCL_CPU_CONFIG_FIELD(T, name) std::atomic<T> name{};
  DFCCL_CPU_CONFIG(DFCCL_CPU_CONFIG_FIELD)
#undef DFCCL_CPU_CONFIG_FIELD
  std::atomic<bool> configured{false};  // every entry set at least once
  std::atomic<uint32_t> set_mask{0};    // bit i: entry i of DFCCL_CPU_CONFIG was set

  // Sets the entries of `kv` this runtime knows (others belong to other
  // backends); throws dfccl::Error (kInvalidArgument) on an invalid value,
  // leaving every entry as it was.
  void Apply(const std::map<std::string, double>& kv);
};

namespace detail {
// Entry i of DFCCL_CPU_CONFIG: its name, its index, a valid value?
inline constexpr const char* kConfigNames[] = {
#define DFCCL_CPU_CONFIG_NAME(T, name) #name,
    DFCCL_CPU_CONFIG(DFCCL_CPU_CONFIG_NAME)
#undef DFCCL_CPU_CONFIG_NAME
};
inline constexpr uint32_t kAllEntries = (1u << (sizeof(kConfigNames) / sizeof(kConfigNames[0]))) - 1;
inline bool ValidEntry(std::string_view name, double v) {
  if (name == "trace") return true;
  if (name == "trace_capacity") return v >= 1 && v == static_cast<double>(static_cast<int64_t>(v));
  if (name == "fault_device") return v >= -1 && v == static_cast<double>(static_cast<int64_t>(v));
  if (name == "fault_start_delay_us" || name == "fault_compute_delay_us") return v >= 0;
  return v > 0;  // timeout_s, spin_budget_us, sticky_budget_us
}
}  // namespace detail

inline void Config::Apply(const std::map<std::string, double>& kv) {
  for (const char* name : detail::kConfigNames) {
    auto it = kv.find(name);
    DFCCL_CHECK(it == kv.end() || detail::ValidEntry(name, it->second),
                "dfccl: invalid value " << it->second << " for config entry " << name << " (CPU runtime)");
  }
  uint32_t mask = 0, bit = 1;
#define DFCCL_CPU_CONFIG_SET(T, name)                                          \
  if (auto it = kv.find(#name); it != kv.end()) {                              \
    name.store(static_cast<T>(it->second));                                    \
    mask |= bit;                                                               \
  }                                                                            \
  bit <<= 1;
  DFCCL_CPU_CONFIG(DFCCL_CPU_CONFIG_SET)
#undef DFCCL_CPU_CONFIG_SET
  if ((set_mask.fetch_or(mask) | mask) == detail::kAllEntries) configured.store(true, std::memory_order_release);
}

}  // namespace dfccl::cpu
