// The small-message identity layout of xla_ffi/device/task.h (protocol "identity"),
// which every rank computes on its own and must agree on: a key's bucket of pool-0
// slots (IdentityWays consecutive slots, inside the pool, the same for every
// sequence number) and an instance's LL tag (never 0, since a consumed header is
// zeroed; distinct for every sequence number of a key, since a cell is reused by
// the next instances of its key).  Built and run under UBSan by
// tests/cpp/test_cpu_runtime.py.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "device/task.h"

#include "check.h"

using namespace dfccl::gpu;


int main() {
  std::mt19937_64 rng(7);
  for (int32_t nslots = 1; nslots <= kMaxPoolSlots; ++nslots) {
    const int32_t ways = IdentityWays(nslots);
    CHECK(ways == std::min(nslots, kIdentityWays));
    for (int i = 0; i < 64; ++i) {
      const uint64_t key = rng();
      const int32_t first = IdentityBucket(key, nslots);
      CHECK(first >= 0 && first % ways == 0 && first + ways <= nslots);
      CHECK(IdentityBucket(key, nslots) == first);  // a pure function of the key: the same on every rank
    }
  }
  // Keys spread over the buckets of the default pool (128 slots: 16 buckets).
  std::vector<int> count(128 / kIdentityWays, 0);
  const int keys = 16000;
  for (int i = 0; i < keys; ++i) count[IdentityBucket(rng(), 128) / kIdentityWays]++;
  for (int c : count) CHECK(c > keys / 16 * 8 / 10 && c < keys / 16 * 12 / 10);
  // Tags: never 0, distinct over a key's sequence numbers.
  for (int k = 0; k < 8; ++k) {
    const uint64_t key = k < 2 ? static_cast<uint64_t>(k) : rng();
    std::vector<uint32_t> tags;
    const int n = 1 << 20;
    tags.reserve(n);
    for (uint64_t s = 0; s < static_cast<uint64_t>(n); ++s) {
      const uint32_t t = IdentityTag(key, s);
      CHECK(t != 0);
      tags.push_back(t);
    }
    std::sort(tags.begin(), tags.end());
    CHECK(std::adjacent_find(tags.begin(), tags.end()) == tags.end());
  }
  std::printf("OK\n");
  return 0;
}
