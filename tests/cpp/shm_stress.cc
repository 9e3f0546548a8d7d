// Stress of the shared-memory matching protocol (xla_ffi/cpu/shm.h) under
// TSan: threads play the ranks of several "processes" over one table in
// ordinary memory.  Each round every rank arrives at K keys in its own random
// order, then polls them in another random order: a ready entry is computed
// (the sum of every rank's staged block) and checked, then released.  One key
// per round has a rank with a different signature: every rank must see the
// mismatch error naming the key, and no instance may stay behind.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpu/shm.h"

using namespace dfccl::shm;

constexpr int kRanks = 6, kProcs = 3, kKeys = 12, kRounds = 300, kElems = 64;

int main() {
  std::vector<char> table_mem(Table::Bytes(256) + 64);
  void* base = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(table_mem.data()) + 63) & ~uintptr_t{63});
  Table::Format(base, kProcs, 256);
  // One arena per process; rank r stages key k of round t at its own offset.
  std::vector<std::vector<float>> arenas(kProcs, std::vector<float>(kRanks * kKeys * kElems));
  std::atomic<int> failures{0}, mismatches_seen{0};
  std::vector<int64_t> devices(kRanks);
  for (int r = 0; r < kRanks; ++r) devices[r] = 100 + r;

  auto rank_main = [&](int r) {
    Table t(base);
    std::mt19937 rng(1234 + r);
    const int proc = r % kProcs;
    for (int round = 0; round < kRounds; ++round) {
      const int bad_key = round % kKeys, bad_rank = round % kRanks;
      std::vector<int> order(kKeys);
      for (int k = 0; k < kKeys; ++k) order[k] = k;
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<Table::PostResult> res(kKeys);
      for (int k : order) {
        float* mine = arenas[proc].data() + (r * kKeys + k) * kElems;
        for (int i = 0; i < kElems; ++i) mine[i] = float(r * 1000 + k + round);
        Table::Post p;
        p.group_hash = 7;
        p.key_hash = 1000 + k;
        p.seq = round;
        p.n = kRanks;
        p.rank = r;
        p.proc = proc;
        p.devices = devices.data();
        p.key = "k" + std::to_string(k);
        p.sig = (k == bad_key && r == bad_rank) ? "sig-other" : "sig";
        p.offset = (r * kKeys + k) * kElems;
        p.start_ns = 0;
        res[k] = t.Arrive(p);
      }
      std::shuffle(order.begin(), order.end(), rng);
      for (int k : order) {
        Table::PostResult& pr = res[k];
        if (pr.failed) {
          mismatches_seen += pr.error.find("'k" + std::to_string(k) + "'") != std::string::npos;
          continue;
        }
        for (;;) {
          if (t.Ready(pr.entry)) {
            const Entry& e = t.entry(pr.entry);
            for (int i = 0; i < kElems; ++i) {
              float sum = 0;
              for (int q = 0; q < kRanks; ++q)
                sum += arenas[e.slots[q].proc][e.slots[q].offset + i];
              float want = 0;
              for (int q = 0; q < kRanks; ++q) want += float(q * 1000 + k + round);
              if (sum != want) ++failures;
            }
            t.ReleaseReader(pr.entry, pr.gen);
            break;
          }
          int32_t kind;
          std::string err;
          if (t.TakeFailure(pr.entry, pr.gen, &kind, &err)) {
            mismatches_seen += err.find("mismatch") != std::string::npos;
            break;
          }
          std::this_thread::yield();
        }
      }
      // Staged blocks are rewritten next round: wait until every reader is done.
      for (int k = 0; k < kKeys; ++k)
        while (!res[k].failed && !t.Reclaimable(res[k].entry, res[k].gen)) std::this_thread::yield();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) threads.emplace_back(rank_main, r);
  for (auto& th : threads) th.join();
  Table t(base);
  const int live = t.live();
  const int want_mismatch = kRounds * kRanks;  // every rank sees each round's mismatch once
  std::printf("failures %d mismatches %d/%d live %d\n", failures.load(), mismatches_seen.load(), want_mismatch, live);
  if (failures == 0 && mismatches_seen == want_mismatch && live == 0) {
    std::printf("OK\n");
    return 0;
  }
  return 1;
}
