// Stress test of the CPU runtime without XLA: 8 threads play 8 devices, start
// collectives in rank-specific random orders, wait for them in other random
// orders and free their inputs right after start() (the runtime copies them: a
// peer reading the caller's buffer is a use-after-free under ASan, a race under
// TSan), then abandon executions between start and done.  Checks every result.
//
//   g++ -std=c++20 -O1 -g -fsanitize=thread -Ixla_ffi/include -Ixla_ffi tests/cpp/runtime_stress.cc \
//       xla_ffi/cpu/{runtime,inspect,daemon,multiprocess,shm,staging}.cc -o /tmp/stress && /tmp/stress
// (tests/cpp/test_cpu_runtime.py builds and runs it under TSan and ASan).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "cpu/runtime.h"

using namespace dfccl;
using namespace dfccl::cpu;

constexpr int N = 8, KEYS = 6, ITERS = 300, E = 33;

static CollectiveSpec MakeSpec(int rank, int key, OpKind kind) {
  CollectiveSpec s;
  s.kind = kind;
  s.reduce = ReduceOp::kSum;
  s.dtype = DType::kF32;
  s.elem_bytes = 4;
  s.nranks = N;
  s.rank = rank;
  s.self_device = rank;
  for (int r = 0; r < N; ++r) s.group_devices.push_back(r);
  s.key = "k" + std::to_string(key);
  s.key_hash = 1000 + key;
  s.site = 1000 + key;  // one start op per key
  s.in_elems = E;
  s.elems_per_block = E;
  s.out_elems = kind == OpKind::kAllGather ? N * E : E;
  if (kind == OpKind::kPermute) { s.send_to = (rank + 1) % N; s.recv_from = (rank + N - 1) % N; }
  return s;
}

// An all-reduce of `elems` elements over the two devices `first` and `first + 1`, under its own key.
static CollectiveSpec PairSpec(int64_t first, int rank, const char* key, int64_t elems) {
  CollectiveSpec c = MakeSpec(rank, 0, OpKind::kAllReduce);
  c.nranks = 2;
  c.group_devices = {first, first + 1};
  c.self_device = first + rank;
  c.key = key;
  c.key_hash = std::hash<std::string>()(key);
  c.site = static_cast<int64_t>(c.key_hash & 0x7fffffff);
  c.in_elems = c.out_elems = c.elems_per_block = elems;
  return c;
}

static OpKind KindOf(int key) {
  static const OpKind kinds[] = {OpKind::kAllReduce, OpKind::kAllGather, OpKind::kPermute};
  return kinds[key % 3];
}

static float Val(int rank, int key, int it, int i) { return float(rank * 7 + key * 3 + it % 11 + i); }

int main() {
  // Every entry, as jax_dfccl.config's defaults (the runtime has none of its own).
  GetConfig().Apply({{"timeout_s", 60}, {"spin_budget_us", 20}, {"sticky_budget_us", 500}, {"trace", 0},
                     {"fault_device", -1}, {"fault_start_delay_us", 0}, {"fault_compute_delay_us", 0},
                     {"trace_capacity", 65536}});
  int failures = 0;
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int rank = 0; rank < N; ++rank) {
    threads.emplace_back([rank, &bad] {
      std::mt19937 rng(rank * 7919 + 1);
      for (int it = 0; it < ITERS; ++it) {
        std::vector<int> order(KEYS);
        for (int k = 0; k < KEYS; ++k) order[k] = k;
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<std::unique_ptr<std::vector<float>>> ins(KEYS), outs(KEYS);
        std::vector<int64_t> tickets(KEYS);
        for (int k : order) {
          auto spec = MakeSpec(rank, k, KindOf(k));
          ins[k] = std::make_unique<std::vector<float>>(E);
          outs[k] = std::make_unique<std::vector<float>>(spec.out_elems, -1.f);
          for (int i = 0; i < E; ++i) (*ins[k])[i] = Val(rank, k, it, i);
          tickets[k] = StartCollective(spec, ins[k]->data());
          ins[k].reset();  // copied at start: XLA may free it at once (an abandoned execution)
        }
        std::shuffle(order.begin(), order.end(), rng);
        for (int k : order) {
          DoneStatus st = WaitCollective(tickets[k], "k" + std::to_string(k), outs[k]->data(),
                                         static_cast<int64_t>(outs[k]->size() * sizeof(float)));
          if (!st.ok()) { std::fprintf(stderr, "error: %s\n", st.message.c_str()); ++bad; }
          const auto& o = *outs[k];
          for (int i = 0; i < E; ++i) {
            float want = 0;
            switch (KindOf(k)) {
              case OpKind::kAllReduce: for (int r = 0; r < N; ++r) want += Val(r, k, it, i); break;
              case OpKind::kAllGather: want = Val(i % N, k, it, i); break;  // checked below
              default: want = Val((rank + N - 1) % N, k, it, i);
            }
            if (KindOf(k) == OpKind::kAllGather) {
              for (int r = 0; r < N; ++r)
                if (o[r * E + i] != Val(r, k, it, i)) { ++bad; break; }
            } else if (o[i] != want) {
              ++bad;
            }
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  StatsSnapshot s = GetStats();
  std::printf("started %lld completed %lld failed %lld preemptions %lld live instances %lld pending %lld bad %d\n",
              (long long)s.started, (long long)s.completed, (long long)s.failed, (long long)s.preemptions,
              (long long)s.instances_live, (long long)s.pending, bad.load());
  failures += bad.load() != 0 || s.completed != N * KEYS * ITERS || s.instances_live != 0 || s.pending != 0;
  // Timeout path: rank 0 alone.
  GetConfig().timeout_s = 0.05;
  std::vector<float> in(E, 1.f), out(E);
  int64_t t = StartCollective(MakeSpec(0, 99, OpKind::kAllReduce), in.data());
  DoneStatus st = WaitCollective(t, "k99", out.data(), E * 4);
  std::printf("timeout: %s\n", st.message.c_str());
  failures += st.ok();
  Reset();
  // A failed execution (RunId 1: ranks 4.. never start key 50, the others time out), then the
  // next execution (RunId 2, every rank): exact, nothing left behind, inputs freed right after done.
  {
    auto phase = [&](int64_t run, int ranks, double timeout) {
      GetConfig().timeout_s = timeout;
      std::vector<std::thread> ts;
      std::atomic<int> errs{0}, wrong{0};
      for (int rank = 0; rank < ranks; ++rank)
        ts.emplace_back([&, rank] {
          auto spec = MakeSpec(rank, 50, OpKind::kAllReduce);
          auto in = std::make_unique<std::vector<float>>(E, float(rank + 1));
          std::vector<float> out(E, -1.f);
          int64_t tk = StartCollective(spec, in->data(), nullptr, run);
          in.reset();
          DoneStatus d = WaitCollective(tk, "k50", out.data(), E * 4);
          if (!d.ok()) ++errs;
          else if (out[0] != float(N * (N + 1) / 2)) ++wrong;
        });
      for (auto& t : ts) t.join();
      return std::make_pair(errs.load(), wrong.load());
    };
    auto [e1, w1] = phase(1, N / 2, 0.05);
    StatsSnapshot mid = GetStats();
    auto [e2, w2] = phase(2, N, 60);
    StatsSnapshot end = GetStats();
    std::printf("failed execution: %d errors, tombstones %lld; next execution: %d errors, %d wrong, tombstones %lld, "
                "live %lld\n", e1, (long long)mid.tombstones, e2, w2, (long long)end.tombstones,
                (long long)end.instances_live);
    failures += e1 != N / 2 || w1 != 0 || mid.tombstones != 1 || e2 != 0 || w2 != 0 || end.tombstones != 0 ||
                end.instances_live != 0;
  }
  Reset();
  // Abort: device 100 fails 'mm' (mismatch with device 101); its started but
  // never-waited 'orphan' (peer never starts it) must fail at once, not time out.
  GetConfig().timeout_s = 60;
  {
    auto two = [](int rank, const char* key, int64_t elems) { return PairSpec(100, rank, key, elems); };
    std::vector<float> a(E, 1.f), b(E, 1.f), o1(E), o2(E), o4(E);
    const int64_t bytes = E * 4;
    int64_t orphan = StartCollective(two(0, "orphan", E), a.data());
    int64_t ok0 = StartCollective(two(0, "ok", E), a.data());
    int64_t ok1 = StartCollective(two(1, "ok", E), b.data());
    int64_t mm0 = StartCollective(two(0, "mm", E), a.data());
    int64_t mm1 = StartCollective(two(1, "mm", E - 1), b.data());
    const int64_t t0 = NowNs();
    DoneStatus e0 = WaitCollective(mm0, "mm", o2.data(), bytes);  // aborts device 100
    DoneStatus e1 = WaitCollective(mm1, "mm", o2.data(), (E - 1) * 4);
    DoneStatus eo = WaitCollective(orphan, "orphan", o1.data(), bytes);
    DoneStatus k1 = WaitCollective(ok1, "ok", o4.data(), bytes);
    const double secs = (NowNs() - t0) * 1e-9;
    std::printf("abort: %s | %s (%.3f s)\n", e0.message.c_str(), eo.message.c_str(), secs);
    failures += e0.ok() || e1.ok() || secs > 5 ||
                eo.message.find("stopped after an error in collective 'mm'") == std::string::npos ||
                !k1.ok() || o4[0] != 2.f;
    (void)ok0;  // device 100's program "aborted": its done never comes
  }
  Reset();
  // An abandoned execution: XLA frees the buffers of a program that failed
  // between a start and its done, and never runs the done.  Device 200 starts
  // 'gone' and its program dies at once (input and output freed); device 201
  // starts it later, and gets the right sum, while nothing touches the freed
  // memory (ASan: no use after free).  A done handed a result of another size is refused.
  {
    auto two = [](int rank, const char* key) { return PairSpec(200, rank, key, E); };
    int abandoned_bad = 0;
    for (int it = 0; it < 50; ++it) {
      auto in0 = std::make_unique<std::vector<float>>(E, float(it));
      StartCollective(two(0, "gone"), in0->data());
      in0.reset();  // the abandoned program's buffers are gone; its done never comes
      std::vector<float> in1(E, 1.f), out1(E, -1.f);
      DoneStatus d = WaitCollective(StartCollective(two(1, "gone"), in1.data()), "gone", out1.data(), E * 4);
      abandoned_bad += !d.ok() || out1[0] != float(it + 1) || out1[E - 1] != float(it + 1);
    }
    std::vector<float> in(E, 1.f), small(E - 1);
    const int64_t w0 = StartCollective(two(0, "size"), in.data()), w1 = StartCollective(two(1, "size"), in.data());
    DoneStatus short_result = WaitCollective(w0, "size", small.data(), (E - 1) * 4);
    DoneStatus other = WaitCollective(w1, "size", in.data(), E * 4);
    std::printf("abandoned executions: %d wrong; short result: %s\n", abandoned_bad, short_result.message.c_str());
    failures += abandoned_bad != 0 || short_result.ok() || !other.ok() ||
                short_result.message.find("'size'") == std::string::npos;
  }
  Reset();
  s = GetStats();
  failures += s.instances_live != 0 || s.key_counters != 0;
  std::printf(failures ? "FAIL\n" : "OK\n");
  return failures ? 1 : 0;
}
