// Protocol C (xla_ffi/transport/announce.cuh) alone on one GPU: N ranks as N
// blocks of one kernel, each a control warp with its own region, over
// StoreTransport (plain stores: the ranks share a process), no daemon, no XLA.
// Each rank runs a chain of 4 KiB instances (Start, passes until ready, its
// members' data checked, Finish) as the daemon's control warp does: lane 0's
// pass, then the warp's puts of the outbox.  Prints per op: the time, the passes,
// the time of a pass and of the shipping; and, as the floor, a flag round trip
// between two blocks.  Tells the protocol's own cost from the daemon's.
//   nvcc -std=c++17 -arch=sm_90a -I xla_ffi -I xla_ffi/include -o /tmp/announce_pass_probe tools/announce_pass_probe.cu
//   /tmp/announce_pass_probe [nranks=2] [iters=2000]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "transport/announce.cuh"

using namespace dfccl::gpu;

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

namespace {

constexpr int kMaxN = 8;
constexpr uint32_t kBytes = 4096;
constexpr uint64_t kBoundNs = 2000000000ull;  // a rank not done in 2 s: the probe fails
constexpr int kStats = 6;
constexpr int kIdlePasses = 1000;

struct Args {
  StoreTransport* t;  // [n], in device memory (Announcer keeps a reference)
  ann::Layout l;
  ann::Config c;
  char* src[kMaxN];   // each rank's message: rank r's bytes all r + 1
  int n, iters;
  unsigned* barrier;
  uint64_t* op_ns;     // [n][iters]
  uint64_t* stats;     // [n][kStats]: passes, pass ns, ship ns, errors, idle pass ns (empty table), idle pass ns (one entry)
  volatile uint64_t* flag;  // [2]: the round trip's words
  int own_shared;      // this rank's own state (Layout::OwnBytes) in the block's shared memory, as the daemon keeps it
};

__device__ void Barrier(unsigned* b, int n, unsigned round) {
  __threadfence_system();
  atomicAdd(b, 1u);
  while (*reinterpret_cast<volatile unsigned*>(b) < round * n) {
  }
  __threadfence_system();
}

__global__ void Chain(Args a) {
  const int r = blockIdx.x, lane = threadIdx.x;
  __shared__ ann::Outbox ob;
  __shared__ int state;
  extern __shared__ __align__(16) char own[];
  ann::Announcer<StoreTransport> an(a.t[r], a.l, a.c, a.own_shared ? own : nullptr);
  if (lane == 0) {
    an.Init();
    ob.n = 0;
  }
  __syncwarp();
  if (lane == 0) Barrier(a.barrier, a.n, 1);
  __syncwarp();
  uint64_t passes = 0, pass_ns = 0, ship_ns = 0, errors = 0, idle0 = 0, idle1 = 0;
  // Passes that find nothing: an empty table; then (rank 0) one entry whose members
  // have not started it (the others wait at the barrier meanwhile); then it runs.
  if (lane == 0) {
    uint64_t t = GlobalTimer();
    for (int i = 0; i < kIdlePasses; ++i) an.Progress();
    idle0 = GlobalTimer() - t;
    int h = -1;
    uint32_t st = 0;
    if (r == 0) {
      h = an.Start(0xCD, 1, 0x51, a.src[r], kBytes, &st);
      an.Progress();
      t = GlobalTimer();
      for (int i = 0; i < kIdlePasses; ++i) an.Progress();
      idle1 = GlobalTimer() - t;
    }
    Barrier(a.barrier, a.n, 2);
    if (r != 0) h = an.Start(0xCD, 1, 0x51, a.src[r], kBytes, &st);
    if (h < 0) errors++;
    const uint64_t t1 = GlobalTimer();
    while (h >= 0 && an.TaskOf(h).state == ann::kRunning && GlobalTimer() - t1 < kBoundNs) an.Progress();
    if (h >= 0) {
      if (an.TaskOf(h).state != ann::kReady) errors++;
      an.Finish(h);
    }
  }
  __syncwarp();
  for (int i = 0; i < a.iters; ++i) {
    const uint64_t t0 = GlobalTimer();
    int h = -1;
    if (lane == 0) {
      uint32_t st = 0;
      h = an.Start(0xAB, static_cast<uint64_t>(i) + 1, 0x51, a.src[r], kBytes, &st);
      if (h < 0) errors++;
    }
    h = __shfl_sync(0xffffffffu, h, 0);
    if (h < 0) break;
    while (true) {
      if (lane == 0) {
        const uint64_t p0 = GlobalTimer();
        an.SetOutbox(&ob, nullptr);
        an.Progress();
        an.SetOutbox(nullptr, nullptr);
        pass_ns += GlobalTimer() - p0;
        passes++;
      }
      __syncwarp();
      const uint64_t s0 = GlobalTimer();
      const int nj = *reinterpret_cast<volatile int*>(&ob.n);
      for (int j = 0; j < nj; ++j) {
        const ann::PutJob job = ob.job[j];
        const uint64_t add = __shfl_sync(0xffffffffu, lane == 0 ? an.Ship(job) : 0ull, 0);
        if (add == 1) a.t[r].PutWarp(lane, job.peer, job.dst_off, job.src, job.bytes, job.sig_off, 1, job.stage_off);
        else if (lane == 0) a.t[r].Put(job.peer, 0, nullptr, 0, job.sig_off, 2);
        if (lane == 0) an.Sent(job);
        __syncwarp();
      }
      __syncwarp();
      if (lane == 0) {
        if (nj) ship_ns += GlobalTimer() - s0;
        ob.n = 0;
        state = an.TaskOf(h).state;
        if (GlobalTimer() - t0 > kBoundNs) state = ann::kFailed;
      }
      __syncwarp();
      if (state != ann::kRunning) break;
    }
    if (lane == 0) {
      if (state != ann::kReady) {
        errors++;
      } else {
        for (int q = 0; q < a.n; ++q) {
          const char* m = an.Received(h, q);
          if (LdVol(m) != static_cast<char>(q + 1) || LdVol(m + kBytes - 1) != static_cast<char>(q + 1)) errors++;
        }
      }
      an.Finish(h);
      a.op_ns[r * a.iters + i] = GlobalTimer() - t0;
    }
    __syncwarp();
    if (state != ann::kReady) break;
  }
  // Drain what is left (the last entries' closing records) before the regions go.
  if (lane == 0) {
    const uint64_t t1 = GlobalTimer();
    while (!an.Empty() && GlobalTimer() - t1 < kBoundNs) an.Progress();
    if (!an.Empty()) errors++;
    uint64_t* o = a.stats + r * kStats;
    o[0] = passes;
    o[1] = pass_ns;
    o[2] = ship_ns;
    o[3] = errors;
    o[4] = idle0;
    o[5] = idle1;
  }
}

// The floor: a flag round trip between blocks 0 and 1 (volatile stores, system fence).
__global__ void PingPong(volatile uint64_t* f, int iters, uint64_t* ns) {
  if (threadIdx.x != 0) return;
  const uint64_t t0 = GlobalTimer();
  for (int i = 1; i <= iters; ++i) {
    if (blockIdx.x == 0) {
      f[1] = i;
      __threadfence_system();
      while (f[0] != static_cast<uint64_t>(i)) {
      }
    } else {
      while (f[1] != static_cast<uint64_t>(i)) {
      }
      f[0] = i;
      __threadfence_system();
    }
  }
  if (blockIdx.x == 0) *ns = GlobalTimer() - t0;
}

// What one thread's ordering operations cost (1000 each, ns per op): block 0 times
// them while block 1 idles; `peer` is memory another "rank" owns (its region).
__global__ void Costs(uint64_t* own, uint64_t* peer, uint64_t* ns) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  constexpr int k = 1000;
  uint64_t acc = 0, t;
  t = GlobalTimer();
  for (int i = 0; i < k; ++i) acc += LdAcquireSys(own + (acc & 1));
  ns[0] = GlobalTimer() - t;
  t = GlobalTimer();
  for (int i = 0; i < k; ++i) acc += LdVol(own + (acc & 1));
  ns[1] = GlobalTimer() - t;
  t = GlobalTimer();
  for (int i = 0; i < k; ++i) {
    StVol(peer + (i & 7), acc);
    FenceAcqRelSys();
  }
  ns[2] = GlobalTimer() - t;
  t = GlobalTimer();
  for (int i = 0; i < k; ++i) {
    StVol(peer + (i & 7), acc);
    __threadfence();
  }
  ns[3] = GlobalTimer() - t;
  t = GlobalTimer();
  for (int i = 0; i < k; ++i) atomicAdd_system(reinterpret_cast<unsigned long long*>(peer + 8), 1ull);
  ns[4] = GlobalTimer() - t;
  // A plain load of a line this thread read just before, after an acquire load (is L1 kept?).
  t = GlobalTimer();
  for (int i = 0; i < k; ++i) {
    acc += LdAcquireSys(own);
    acc += *reinterpret_cast<const uint64_t*>(own + 16 + (acc & 1));
  }
  ns[5] = GlobalTimer() - t;
  t = GlobalTimer();
  for (int i = 0; i < k; ++i) {
    acc += LdVol(own);
    acc += *reinterpret_cast<const uint64_t*>(own + 16 + (acc & 1));
  }
  ns[6] = GlobalTimer() - t;
  // A plain load of a line this thread keeps reading, without and with its own store to the line
  // just before (does the store evict it from L1? the Announcer's state is such lines).
  volatile uint64_t* line = own + 32;
  t = GlobalTimer();
  for (int i = 0; i < k; ++i) acc += *reinterpret_cast<const uint64_t*>(own + 33 + (acc & 1) * 2);
  ns[7] = GlobalTimer() - t;
  t = GlobalTimer();
  for (int i = 0; i < k; ++i) {
    *reinterpret_cast<uint64_t*>(const_cast<uint64_t*>(line)) = acc;
    acc += *reinterpret_cast<const uint64_t*>(own + 33 + (acc & 1) * 2);
  }
  ns[8] = GlobalTimer() - t;
  ns[9] = acc;
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? atoi(argv[1]) : 2;
  const int iters = argc > 2 ? atoi(argv[2]) : 2000;
  if (n < 2 || n > kMaxN) return 2;
  ann::Geometry g{n, 64, std::max(64, 2 * n * 16), 16, 16, kBytes};  // as the runtime's (communicator.cc)
  Args a{};
  a.l = ann::Layout::Of(g);
  a.c.timeout_ns = 1000000000ull;
  a.c.grace_ns = 100000000ull;
  a.n = n;
  a.iters = iters;
  std::vector<StoreTransport> ts(n);
  std::vector<char*> region(n);
  for (int r = 0; r < n; ++r) {
    CHECK(cudaMalloc(&region[r], a.l.bytes));
    CHECK(cudaMemset(region[r], 0, a.l.bytes));
    CHECK(cudaMalloc(&a.src[r], kBytes));
    CHECK(cudaMemset(a.src[r], r + 1, kBytes));
  }
  for (int r = 0; r < n; ++r) {
    ts[r].rank = r;
    ts[r].nranks = n;
    for (int q = 0; q < n; ++q) ts[r].base[q] = region[q];
  }
  CHECK(cudaMalloc(&a.t, n * sizeof(StoreTransport)));
  CHECK(cudaMemcpy(a.t, ts.data(), n * sizeof(StoreTransport), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&a.barrier, 4));
  CHECK(cudaMemset(a.barrier, 0, 4));
  CHECK(cudaMalloc(&a.op_ns, sizeof(uint64_t) * n * iters));
  CHECK(cudaMalloc(&a.stats, sizeof(uint64_t) * n * kStats));
  uint64_t* flag = nullptr;
  CHECK(cudaMalloc(&flag, 3 * sizeof(uint64_t)));
  CHECK(cudaMemset(flag, 0, 3 * sizeof(uint64_t)));

  // Twice: the own state in the region, then in shared memory (the daemon's way).
  const uint32_t own_bytes = static_cast<uint32_t>(a.l.OwnBytes());
  CHECK(cudaFuncSetAttribute(Chain, cudaFuncAttributeMaxDynamicSharedMemorySize, own_bytes));
  uint64_t errors = 0;
  for (int mode = 0; mode < 2; ++mode) {
    a.own_shared = mode;
    for (int r = 0; r < n; ++r) CHECK(cudaMemset(region[r], 0, a.l.bytes));
    CHECK(cudaMemset(a.barrier, 0, 4));
    Chain<<<n, 32, mode ? own_bytes : 0>>>(a);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<uint64_t> op(n * iters), st(n * kStats);
    CHECK(cudaMemcpy(op.data(), a.op_ns, op.size() * 8, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(st.data(), a.stats, st.size() * 8, cudaMemcpyDeviceToHost));
    for (int r = 0; r < n; ++r) {
      std::vector<uint64_t> v(op.begin() + r * iters + iters / 10, op.begin() + (r + 1) * iters);
      std::sort(v.begin(), v.end());
      const uint64_t* o = st.data() + r * kStats;
      printf("ROW {\"probe\": \"announce_pass\", \"own_state\": \"%s\", \"own_bytes\": %u, \"nranks\": %d, \"rank\": %d, "
             "\"op_us_median\": %.2f, \"op_us_p90\": %.2f, \"passes_per_op\": %.1f, \"pass_us\": %.3f, \"ship_us_per_op\": %.3f, "
             "\"idle_pass_us_empty\": %.3f, \"idle_pass_us_one_entry\": %.3f, \"errors\": %llu}\n",
             mode ? "shared" : "region", own_bytes, n, r, v[v.size() / 2] / 1e3, v[v.size() * 9 / 10] / 1e3,
             static_cast<double>(o[0]) / iters, o[0] ? o[1] / 1e3 / o[0] : 0.0, o[2] / 1e3 / iters,
             o[4] / 1e3 / kIdlePasses, o[5] / 1e3 / kIdlePasses, static_cast<unsigned long long>(o[3]));
      errors += o[3];
    }
  }
  PingPong<<<2, 32>>>(flag, 10000, flag + 2);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  uint64_t pp = 0;
  CHECK(cudaMemcpy(&pp, flag + 2, 8, cudaMemcpyDeviceToHost));
  printf("ROW {\"probe\": \"flag_round_trip\", \"us\": %.3f}\n", pp / 1e3 / 10000);
  uint64_t* cost = nullptr;
  CHECK(cudaMalloc(&cost, 10 * sizeof(uint64_t)));
  Costs<<<2, 32>>>(reinterpret_cast<uint64_t*>(region[0]), reinterpret_cast<uint64_t*>(region[1]), cost);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  uint64_t c[10];
  CHECK(cudaMemcpy(c, cost, sizeof(c), cudaMemcpyDeviceToHost));
  printf("ROW {\"probe\": \"costs_ns\", \"ld_acquire_sys\": %.1f, \"ld_volatile\": %.1f, \"store_fence_sys\": %.1f, "
         "\"store_fence_gpu\": %.1f, \"atomic_add_system\": %.1f, \"acquire_then_plain\": %.1f, \"volatile_then_plain\": %.1f, "
         "\"plain_reload\": %.1f, \"own_store_then_plain_reload\": %.1f}\n",
         c[0] / 1e3, c[1] / 1e3, c[2] / 1e3, c[3] / 1e3, c[4] / 1e3, c[5] / 1e3, c[6] / 1e3, c[7] / 1e3, c[8] / 1e3);
  return errors ? 1 : 0;
}
