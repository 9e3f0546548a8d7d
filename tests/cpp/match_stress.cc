// The device's instance matching (xla_ffi/device/match.cuh) on the host: threads as
// the control warps of one communicator's ranks, sharing one MatchTable
// (tests/cpp/device_shim stands in for the device primitives; built and run under
// TSan and ASan by tests/cpp/test_cpu_runtime.py).
//
// Rounds of blocks.  A block is W instances (key, seq), the same set on every rank
// (so every rank can complete it: the table only has to let them), started by each
// rank in an order of its own, one start per pass over its pending tasks, which it
// drives as the daemon does: arrive (bounded lock budget; retry on a busy lock or a
// full bucket), claim a slot on a later pass if the instance had none, then "run"
// it: store its word (the slot's epoch and the instance's id) into the slot's area
// and wait, without blocking, moving on to its other tasks, until every rank's word
// of that epoch and id is there; then leave.  Pools of fewer slots than a block has
// instances make instances wait for slots; crowded rounds put every instance into
// one bucket (W <= the ways); one instance of some blocks has another signature on
// the last rank, and one is failed by one rank right after its arrival (Fail, as
// its control warp does when the host aborts it), so every rank's task must fail with
// that status (at its arrival, its claim, or by CheckFailed while it waits) and the
// entry still be freed.
//
// Checks: a rank never finds a later use of its slot while it holds it (a slot
// serving two instances at once); every rank sees the same slot and epoch for an
// instance; the failed instances fail on every rank, naming the mismatch, and no
// other does; every block completes within a deadline (no deadlock); at the end
// the table is empty: no entry, every slot free, no lock held.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "device/match.cuh"

using namespace dfccl::gpu;

namespace {

constexpr int64_t kBudgetNs = 20000;  // the submit kernel's lock budget (device/submit.cuh)
constexpr double kDeadlineS = 60.0;

struct Instance {
  uint64_t key_hash;
  uint64_t seq;
  int pool;
  bool mismatch;  // the last rank starts it with another signature
  int abort_rank = -1;  // this rank fails the instance once it has arrived (as its control warp does on the host's abort)
};

struct Seen {  // what a rank saw of an instance
  int32_t slot = -1;
  uint32_t epoch = 0;
  uint32_t status = 0;  // 0: completed; else the failure's PackStatus
};

struct Shared {
  MatchTable* table;
  CommDev comm;
  int nranks;
  std::vector<uint64_t> area[kNumPools];  // [slot][rank]: epoch << 32 | low word of the id
  std::mutex mu;
  std::vector<std::map<std::pair<uint64_t, uint64_t>, Seen>> seen;  // per rank
  std::atomic<bool> failed{false};
  double deadline_s = kDeadlineS;
};

void Die(Shared& s, const char* what, int rank, const Instance& in, const TaskDesc& d, uint64_t extra = 0) {
  std::fprintf(stderr, "match_stress: rank %d: %s: key %llx seq %llu pool %d slot %d epoch %u match %d (%llx)\n",
               rank, what, static_cast<unsigned long long>(in.key_hash), static_cast<unsigned long long>(in.seq),
               in.pool, d.slot, d.epoch, d.match, static_cast<unsigned long long>(extra));
  s.failed = true;
}

struct Task {
  Instance in;
  TaskDesc d{};
  int state = 0;  // 0: to arrive; 1: arrived, no slot; 2: running (word stored); 3: finished
};

// One rank's pass over its pending tasks until all of `block` (in its order) finished.
void RunBlock(Shared& s, int rank, const std::vector<Instance>& order) {
  std::vector<Task> tasks(order.size());
  size_t started = 0, finished = 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto record = [&](Task& t, uint32_t status) {
    std::lock_guard lk(s.mu);
    s.seen[rank][{t.in.key_hash, t.in.seq}] = Seen{t.d.slot, t.d.epoch, status};
  };
  auto leave = [&](Task& t) {  // as CompleteTask: the slot as the task has it (with its epoch), else the entry's
    Leave(s.table, t.d.match, s.nranks, t.d.epoch != 0 ? t.d.slot : -1, t.d.pool);
    t.state = 3;
    finished++;
  };
  auto word = [](const Task& t) {  // this use of the slot: its epoch and the instance's id
    return static_cast<uint64_t>(t.d.epoch) << 32 | (MatchId(t.in.key_hash, t.in.seq) & 0xffffffffu);
  };
  auto store_word = [&](Task& t) {
    const uint64_t w = word(t);
    uint64_t& cell = s.area[t.d.pool][static_cast<size_t>(t.d.slot) * s.nranks + rank];
    const uint64_t before = std::atomic_ref<uint64_t>(cell).load(std::memory_order_relaxed);
    if ((before >> 32) >= t.d.epoch) Die(s, "the slot's area holds a use not older than this one", rank, t.in, t.d, before);
    std::atomic_ref<uint64_t>(cell).store(w, std::memory_order_release);
    t.state = 2;
  };
  while (finished < tasks.size() && !s.failed) {
    if (started < tasks.size()) {  // the next start of this rank's order
      Task& t = tasks[started++];
      t.in = order[started - 1];
      t.d.key_hash = t.in.key_hash;
      t.d.seq = t.in.seq;
      t.d.comm = &s.comm;
      t.d.nranks = s.nranks;
      t.d.rank = rank;
      t.d.pool = t.in.pool;
      t.d.sig_hash = 0x5157 + (t.in.mismatch && rank == s.nranks - 1 ? 1 : 0);
      t.d.slot = -1;
      t.d.epoch = 0;
      t.d.match = -1;
    }
    for (size_t i = 0; i < started; ++i) {
      Task& t = tasks[i];
      uint32_t why = 0;
      int r = kMatchRetry;
      if (t.state == 0) {
        r = Arrive(t.d, &t.d, 0u, &why, kBudgetNs);
        if (r == kMatchArrived) t.state = 1;
      } else if (t.state == 1) {
        r = ClaimSlot(t.d, &t.d, &why, kBudgetNs);
      } else if (t.state == 2) {
        if (const uint32_t f = CheckFailed(t.d)) {
          record(t, f);
          leave(t);
          continue;
        }
        const uint64_t want = word(t);
        bool all = true;
        for (int q = 0; q < s.nranks; ++q) {
          const uint64_t w = std::atomic_ref<uint64_t>(s.area[t.d.pool][static_cast<size_t>(t.d.slot) * s.nranks + q])
                                 .load(std::memory_order_acquire);
          if ((w >> 32) > t.d.epoch) Die(s, "a later use of the slot while this one holds it", rank, t.in, t.d, w);
          if (w != want) all = false;
        }
        if (all) {
          record(t, 0);
          leave(t);
        }
        continue;
      } else {
        continue;
      }
      if (r != kMatchFailed && r != kMatchRetry && t.in.abort_rank == rank) {
        // Arrived, before its word is stored (so no rank can complete the instance):
        // the first failure of the instance wins.
        Fail(t.d, PackStatus(kStatusAborted, rank, rank));
        record(t, CheckFailed(t.d));
        leave(t);
      } else if (r == kMatchFailed) {
        record(t, why);
        leave(t);
      } else if (r == kMatchSlotted) {
        if (t.d.slot < 0 || t.d.epoch == 0) Die(s, "slotted without a slot or epoch", rank, t.in, t.d);
        store_word(t);
      }
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > s.deadline_s) {
      for (Task& t : tasks)
        if (t.state != 3) Die(s, "block not finished by the deadline (state in extra)", rank, t.in, t.d, t.state);
      return;
    }
  }
}

bool TableEmpty(const Shared& s, const int nslots[kNumPools]) {
  for (int b = 0; b < kMatchBuckets; ++b) {
    if (s.table->lock[b] != 0) { std::fprintf(stderr, "match_stress: bucket %d still locked\n", b); return false; }
    for (int w = 0; w < kMatchWays; ++w)
      if (s.table->entry[b][w].id != 0) {
        std::fprintf(stderr, "match_stress: entry %d/%d still live (seq %llu)\n", b, w,
                     static_cast<unsigned long long>(s.table->entry[b][w].seq));
        return false;
      }
  }
  for (int p = 0; p < kNumPools; ++p)
    for (int i = 0; i < nslots[p]; ++i)
      if (!(s.table->free_bits[p][i / 64] >> (i % 64) & 1ull)) {
        std::fprintf(stderr, "match_stress: pool %d slot %d not freed\n", p, i);
        return false;
      }
  return true;
}

std::unique_ptr<MatchTable> NewTable(const int nslots[kNumPools]) {
  auto table = std::make_unique<MatchTable>();
  *table = MatchTable{};
  for (int p = 0; p < kNumPools; ++p)
    for (int i = 0; i < nslots[p]; ++i) table->free_bits[p][i / 64] |= 1ull << (i % 64);
  return table;
}

void Setup(Shared& s, MatchTable* table, int nranks, const int nslots[kNumPools]) {
  s.table = table;
  s.nranks = nranks;
  s.comm.nranks = nranks;
  s.comm.table = table;
  for (int p = 0; p < kNumPools; ++p) {
    s.comm.pool[p].nslots = nslots[p];
    s.area[p].assign(static_cast<size_t>(nslots[p]) * nranks, 0);
  }
  s.seen.resize(nranks);
}

// One round: `blocks` blocks of W instances over `nranks` threads.
bool Round(int nranks, int W, int blocks, const int nslots[kNumPools], bool crowded, uint64_t seed) {
  auto table = NewTable(nslots);
  Shared s;
  Setup(s, table.get(), nranks, nslots);

  std::mt19937_64 rng(seed);
  // Keys: a key's sequence numbers count its uses; crowded rounds take a fresh key
  // per instance whose (key, 0) falls into bucket 7.
  std::vector<uint64_t> keys(2 * W);
  for (auto& k : keys) k = rng();
  std::map<uint64_t, uint64_t> uses;
  std::vector<std::vector<Instance>> plan(blocks);
  for (int b = 0; b < blocks; ++b) {
    std::vector<uint64_t> ks;
    if (crowded) {
      while (static_cast<int>(ks.size()) < W) {
        const uint64_t k = rng();
        if (MatchBucket(MatchId(k, 0)) == 7) ks.push_back(k);
      }
    } else {
      ks = keys;
      std::shuffle(ks.begin(), ks.end(), rng);
      ks.resize(W);
    }
    for (int i = 0; i < W; ++i) {
      Instance in{ks[i], uses[ks[i]]++, static_cast<int>(rng() % kNumPools), false};
      in.mismatch = i == 0 && b % 5 == 4;
      if (i == 1 && b % 7 == 3) in.abort_rank = b % nranks;
      plan[b].push_back(in);
    }
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < nranks; ++r)
    threads.emplace_back([&, r] {
      std::mt19937_64 own(seed * 31 + r);
      for (int b = 0; b < blocks && !s.failed; ++b) {
        std::vector<Instance> order = plan[b];
        std::shuffle(order.begin(), order.end(), own);
        RunBlock(s, r, order);
      }
    });
  for (auto& t : threads) t.join();
  if (s.failed) return false;

  // Every rank saw every instance the same way.
  for (int b = 0; b < blocks; ++b)
    for (const Instance& in : plan[b]) {
      const Seen& z = s.seen[0][{in.key_hash, in.seq}];
      for (int r = 0; r < nranks; ++r) {
        const auto it = s.seen[r].find({in.key_hash, in.seq});
        if (it == s.seen[r].end()) { std::fprintf(stderr, "match_stress: rank %d never finished an instance\n", r); return false; }
        const Seen& v = it->second;
        if (in.mismatch) {
          if ((v.status & 0xff) != kStatusMismatch) {
            std::fprintf(stderr, "match_stress: rank %d: mismatched instance ended with status %x\n", r, v.status);
            return false;
          }
        } else if (in.abort_rank >= 0) {
          if (v.status != PackStatus(kStatusAborted, in.abort_rank, in.abort_rank)) {
            std::fprintf(stderr, "match_stress: rank %d: instance aborted by rank %d ended with status %x\n", r,
                         in.abort_rank, v.status);
            return false;
          }
        } else if (v.status != 0 || v.slot != z.slot || v.epoch != z.epoch) {
          std::fprintf(stderr, "match_stress: rank %d: slot %d epoch %u status %x, rank 0 slot %d epoch %u\n", r,
                       v.slot, v.epoch, v.status, z.slot, z.epoch);
          return false;
        }
      }
    }
  return TableEmpty(s, nslots);
}


// The case the reserve slot is for (pool 0 with S slots, two ranks): rank 0 starts
// A_1 .. A_k and then B; rank 1 starts B and only after B completed the A's (a
// legal order-free program).  Rank 0's arrivals take the pool's unreserved slots
// for A's, which wait for rank 1, which waits for B: B, which both ranks arrived
// at, must still get a slot (the reserve), however many A's there are.  Returns
// whether the program finished.
bool DirectedSlots(int k, int nslots_pool0) {
  const int nslots[kNumPools] = {nslots_pool0, 1};
  auto table = NewTable(nslots);
  Shared s;
  Setup(s, table.get(), 2, nslots);
  s.deadline_s = 10.0;
  std::vector<Instance> as;
  for (int i = 0; i < k; ++i) as.push_back(Instance{0xA000 + static_cast<uint64_t>(i), 0, 0, false});
  const Instance b{0xB000, 0, 0, false};
  std::vector<Instance> order0 = as;
  order0.push_back(b);
  std::thread t0([&] { RunBlock(s, 0, order0); });
  std::thread t1([&] {
    RunBlock(s, 1, {b});
    if (!s.failed) RunBlock(s, 1, as);
  });
  t0.join();
  t1.join();
  return !s.failed && TableEmpty(s, nslots);
}

// Protocol "run" (device/task.h), one thread: two ranks arrive at one instance
// with launch ids `run0` then `run1` (rank 0 first, or a tombstone of rank 0
// when tomb0), then both leave.  Returns the statuses they got ({0, 0}: paired).
std::pair<uint32_t, uint32_t> TwoRuns(uint32_t run0, uint32_t run1, bool tomb0 = false) {
  const int nslots[kNumPools] = {2, 2};
  auto table = NewTable(nslots);
  Shared s;
  Setup(s, table.get(), 2, nslots);
  TaskDesc d[2]{};
  uint32_t st[2] = {0, 0};
  int r[2];
  for (int k = 0; k < 2; ++k) {
    d[k].key_hash = 0xC0FFEE;
    d[k].seq = 7;
    d[k].comm = &s.comm;
    d[k].nranks = 2;
    d[k].rank = k;
    d[k].pool = 0;
    d[k].sig_hash = 0x5157;
    d[k].slot = -1;
    d[k].match = -1;
    d[k].run = k == 0 ? run0 : run1;
    const uint32_t fail = k == 0 && tomb0 ? PackStatus(kStatusLeftBehind, 0, 0) : 0u;
    r[k] = Arrive(d[k], &d[k], fail, &st[k], kBudgetNs);
  }
  for (int k = 0; k < 2; ++k) {
    if (r[k] != kMatchFailed && !st[k]) st[k] = CheckFailed(d[k]);
    Leave(s.table, d[k].match, 2, d[k].epoch != 0 ? d[k].slot : -1, d[k].pool);
  }
  if (!TableEmpty(s, nslots)) return {~0u, ~0u};
  return {st[0], st[1]};
}

bool Runs() {
  struct Case { uint32_t run0, run1; bool tomb0; uint32_t want0, want1; const char* what; };
  const uint32_t behind = PackStatus(kStatusLeftBehind, 1, 0), ahead = PackStatus(kStatusLeftBehind, 0, 1),
                 tomb = PackStatus(kStatusLeftBehind, 0, 0);
  const Case cases[] = {
      {100, 100, false, 0, 0, "the same execution pairs"},
      {0, 100, false, 0, 0, "an unknown launch id (inside a command buffer) pairs"},
      {100, 0, false, 0, 0, "... either way"},
      {100, 100 + 5000, false, 0, 0, "different programs pair (MPMD)"},
      {100, 101, false, behind, behind, "rank 1 an execution ahead: both fail, naming rank 1 first"},
      {101, 100, false, ahead, ahead, "rank 0 an execution ahead: both fail, naming rank 0 first"},
      {0xffffffffu, 2, false, behind, behind, "ahead across the 32-bit wrap"},
      {0, 100, true, tomb, tomb, "a tombstone of rank 0: rank 1's task fails naming it"},
  };
  for (const Case& c : cases) {
    const auto [s0, s1] = TwoRuns(c.run0, c.run1, c.tomb0);
    if (s0 != c.want0 || s1 != c.want1) {
      std::fprintf(stderr, "match_stress: runs %u, %u%s (%s): statuses %x, %x, want %x, %x\n", c.run0, c.run1,
                   c.tomb0 ? " (tombstone)" : "", c.what, s0, s1, c.want0, c.want1);
      return false;
    }
  }
  return true;
}

}  // namespace

int main() {
  if (!Runs()) return 1;
  struct Cfg { int nranks, W, blocks; int slots0, slots1; bool crowded; };
  const Cfg cfgs[] = {
      {2, 8, 60, 3, 2, false},   // fewer slots than a block's instances: waits for slots
      {3, 12, 40, 16, 16, false},
      {4, 6, 40, 1, 1, false},   // one slot per pool
      {3, 5, 60, 2, 2, true},    // every instance in one bucket: one lock, ways reused
      {8, 4, 20, 2, 3, false},
  };
  uint64_t seed = 1;
  for (const Cfg& c : cfgs) {
    const int nslots[kNumPools] = {c.slots0, c.slots1};
    for (int rep = 0; rep < 3; ++rep, ++seed)
      if (!Round(c.nranks, c.W, c.blocks, nslots, c.crowded, seed)) {
        std::fprintf(stderr, "match_stress: FAILED (ranks %d, block %d, slots %d/%d, crowded %d, seed %llu)\n",
                     c.nranks, c.W, c.slots0, c.slots1, c.crowded, static_cast<unsigned long long>(seed));
        return 1;
      }
  }
  for (int slots : {1, 2, 3})
    for (int k : {1, 3, 8})
      if (!DirectedSlots(k, slots)) {
        std::fprintf(stderr, "match_stress: %d slots, %d instances started ahead of a peer: did not finish\n",
                     slots, k);
        return 1;
      }
  std::printf("OK\n");
  return 0;
}
