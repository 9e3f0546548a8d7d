// Stress of the shared-memory matching protocol (xla_ffi/cpu/shm.h) under
// TSan: threads play the ranks of several "processes" over one table in
// ordinary memory.  Each round every rank arrives at K keys in its own random
// order, then polls them in another random order: a ready entry is computed
// (the sum of every rank's staged block) and checked, then released.  One key
// per round has a rank with a different signature: every rank must see the
// mismatch error naming the key, and no instance may stay behind.
// First, single-threaded: the execution identity (dfccl/execution.h) — a rank
// arriving from a later or an earlier execution of the same program than a
// posted rank, and ranks of different programs.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "cpu/shm.h"
#include "dfccl/execution.h"

using namespace dfccl::shm;

constexpr int kRanks = 6, kProcs = 3, kKeys = 12, kRounds = 300, kElems = 64;

// Two ranks of two processes over a fresh table: (rank, seq, launch id) arrivals.
void ExecutionIdentity() {
  std::vector<char> mem(Table::Bytes(16) + 64);
  void* base = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(mem.data()) + 63) & ~uintptr_t{63});
  Table::Format(base, 2, 16);
  Table t(base);
  const int64_t devices[2] = {100, 101};
  auto post = [&](int rank, int64_t seq, int64_t run, uint64_t key = 1) {
    Table::Post p;
    p.group_hash = 7;
    p.key_hash = key;
    p.seq = seq;
    p.n = 2;
    p.rank = rank;
    p.proc = rank;
    p.devices = devices;
    p.key = "k";
    p.sig = "sig";
    p.offset = 0;
    p.start_ns = 0;
    p.run = run;
    return t.Arrive(p);
  };
  const int32_t aborted = static_cast<int32_t>(dfccl::ErrorCode::kAborted);
  // Process 0's execution 10 failed before the start that process 1's execution 10 made;
  // process 0 starts it again in execution 11.
  auto a = post(1, 0, 10);
  CHECK(!a.failed && !a.ready && !a.skip);
  auto b = post(0, 0, 11);
  CHECK(b.skip && !b.failed);  // not its instance: on to the next sequence number
  int32_t kind = 0;
  std::string err;
  CHECK(t.TakeFailure(a.entry, a.gen, &kind, &err));  // process 1's execution 10 fails
  CHECK(kind == aborted && err.find("a peer's program failed") != std::string::npos &&
         err.find("launch id 11") != std::string::npos && err.find("[1 (device 101, process 1)]") != std::string::npos);
  b = post(0, 1, 11);
  CHECK(!b.failed && !b.ready);
  a = post(1, 1, 11);  // process 1's next execution meets it
  CHECK(a.ready && a.entry == b.entry);
  t.ReleaseReader(a.entry, a.gen);
  t.ReleaseReader(b.entry, b.gen);
  // The other way round: process 1 is ahead (execution 12 posted), process 0 arrives from execution 11.
  auto c = post(1, 2, 12);
  auto d = post(0, 2, 11);
  CHECK(d.failed && d.undo && d.err_kind == aborted && d.error.find("launch id 12") != std::string::npos);
  d = post(0, 2, 12);  // its sequence number was not consumed: its next execution meets process 1's
  CHECK(d.ready && d.entry == c.entry);
  t.ReleaseReader(c.entry, c.gen);
  t.ReleaseReader(d.entry, d.gen);
  // Different programs (launch ids far apart) pair by key and sequence number.
  auto e = post(0, 0, 5, 2);
  auto f = post(1, 0, 5 + 3 * dfccl::kRunWindow, 2);
  CHECK(f.ready && e.entry == f.entry);
  t.ReleaseReader(e.entry, e.gen);
  t.ReleaseReader(f.entry, f.gen);
  // Launch ids are 32-bit: executions on either side of the wrap are neighbours.
  auto g = post(0, 0, 0xffffffffll, 3);
  auto h = post(1, 0, 0x100000000ll, 3);
  CHECK(h.skip);
  CHECK(t.TakeFailure(g.entry, g.gen, &kind, &err));
  CHECK(t.live() == 0);
  std::printf("execution identity OK\n");
}

int main() {
  ExecutionIdentity();
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
        p.run = 1000 + round;
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
