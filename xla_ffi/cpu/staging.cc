#include "cpu/staging.h"

#include <sys/mman.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

#include "dfccl/check.h"

namespace dfccl::cpu {
namespace {

constexpr int kMinShift = 12, kMaxShift = 26;  // kMinPooledBytes, kMaxPooledBytes
static_assert(int64_t{1} << kMinShift == kMinPooledBytes && int64_t{1} << kMaxShift == kMaxPooledBytes);

struct Pool {
  std::mutex mu;
  std::array<std::vector<std::byte*>, kMaxShift + 1> free;  // by log2 of the size
  int64_t retained = 0;                                      // under mu
  std::atomic<int64_t> in_use{0};
};
Pool& P() {
  static Pool* p = new Pool;  // leaked: tasks may outlive static destruction
  return *p;
}

int ShiftFor(int64_t bytes) {
  int s = kMinShift;
  while ((int64_t{1} << s) < bytes) ++s;
  return s;
}

std::byte* Map(int64_t bytes) {
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  DFCCL_CHECK_CODE(p != MAP_FAILED, ErrorCode::kResourceExhausted,
                   "dfccl: the CPU runtime could not map " << bytes << " bytes for a collective's staging");
  return static_cast<std::byte*>(p);
}

}  // namespace

Staging::Staging(int64_t bytes) {
  if (bytes <= 0) return;
  Pool& pool = P();
  if (bytes < kMinPooledBytes) {
    p_ = static_cast<std::byte*>(::operator new(static_cast<size_t>(bytes), std::align_val_t{64}));
    cap_ = bytes;
  } else if (bytes > kMaxPooledBytes) {
    p_ = Map(bytes);
    cap_ = bytes;
  } else {
    const int s = ShiftFor(bytes);
    cap_ = int64_t{1} << s;
    {
      std::lock_guard<std::mutex> l(pool.mu);
      if (!pool.free[s].empty()) {
        p_ = pool.free[s].back();
        pool.free[s].pop_back();
        pool.retained -= cap_;
      }
    }
    if (p_ == nullptr) p_ = Map(cap_);
  }
  pool.in_use.fetch_add(cap_, std::memory_order_relaxed);
}

Staging& Staging::operator=(Staging&& o) noexcept {
  if (this != &o) {
    reset();
    p_ = o.p_, cap_ = o.cap_;
    o.p_ = nullptr, o.cap_ = 0;
  }
  return *this;
}

void Staging::reset() {
  if (p_ == nullptr) return;
  Pool& pool = P();
  pool.in_use.fetch_sub(cap_, std::memory_order_relaxed);
  if (cap_ < kMinPooledBytes) {
    ::operator delete(p_, std::align_val_t{64});
  } else {
    bool kept = false;
    if (cap_ <= kMaxPooledBytes) {
      std::lock_guard<std::mutex> l(pool.mu);
      if (pool.retained + cap_ <= kRetainBytes) {
        pool.free[ShiftFor(cap_)].push_back(p_);
        pool.retained += cap_;
        kept = true;
      }
    }
    if (!kept) munmap(p_, static_cast<size_t>(cap_));
  }
  p_ = nullptr;
  cap_ = 0;
}

StagingStats GetStagingStats() {
  Pool& pool = P();
  std::lock_guard<std::mutex> l(pool.mu);
  return {pool.in_use.load(std::memory_order_relaxed), pool.retained};
}

void TrimStaging() {
  Pool& pool = P();
  std::lock_guard<std::mutex> l(pool.mu);
  for (int s = kMinShift; s <= kMaxShift; ++s) {
    for (std::byte* p : pool.free[s]) munmap(p, static_cast<size_t>(int64_t{1} << s));
    pool.free[s].clear();
  }
  pool.retained = 0;
}

}  // namespace dfccl::cpu
