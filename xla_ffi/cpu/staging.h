// Runtime-owned memory for the inputs and outputs of collectives in flight
// (Task::in_stage / out_stage: see runtime.h for why the runtime never reads or
// writes XLA's buffers after a start returned).
//
// One allocation per start and done would go through malloc from XLA's device
// threads and be freed on the runtime's threads: the heap then fragments and
// the process grows (measured: the soak of tests/gpu/soak_worker.py on 4 CPU
// devices, 1 B - 4 MiB and 64 MiB: peak RSS 0.89-0.94 GB growing 4-6% after
// warm-up, against 0.57 GB and +0.7% when the runtime used XLA's buffers; with
// this pool 0.62-0.63 GB and -0.1 to +0.6%).  So sizes from kMinPooledBytes to kMaxPooledBytes are
// rounded up to a power of two, mapped with mmap (outside the heap) and
// recycled; a released buffer is kept for reuse while the pool keeps at most
// kRetainBytes, else unmapped.  Larger buffers are mapped and unmapped per use;
// smaller ones come from malloc.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dfccl::cpu {

inline constexpr int64_t kMinPooledBytes = int64_t{4} << 10;
inline constexpr int64_t kMaxPooledBytes = int64_t{64} << 20;
inline constexpr int64_t kRetainBytes = int64_t{64} << 20;

// A buffer of at least `bytes` bytes (uninitialized), 64-byte aligned; move-only.
class Staging {
 public:
  Staging() = default;
  explicit Staging(int64_t bytes);
  Staging(Staging&& o) noexcept : p_(o.p_), cap_(o.cap_) { o.p_ = nullptr, o.cap_ = 0; }
  Staging& operator=(Staging&& o) noexcept;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() { reset(); }

  std::byte* data() const { return p_; }
  void reset();  // back to the pool (or the system)

 private:
  std::byte* p_ = nullptr;
  int64_t cap_ = 0;  // the size it was obtained with (its size class)
};

struct StagingStats {
  int64_t in_use_bytes;    // held by tasks (size classes, not requested sizes)
  int64_t retained_bytes;  // released and kept for reuse
};
StagingStats GetStagingStats();
// Unmaps every retained buffer (reset()).
void TrimStaging();

}  // namespace dfccl::cpu
