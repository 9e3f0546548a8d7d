// NVSHMEM on the one-GPU MPS testbed: several PEs (one per process) on one GPU, NVSHMEM's own
// put-with-signal round trip and its on-stream collectives.  See README.md beside this file.
//
// Run by tools/mps_testbed.sh, which gives each process DFCCL_TESTBED_RANK / _NPROC / _TMP:
//
//   tools/mps_testbed.sh -n 2 -- tools/nvshmem_probe/build/probe --json out.json
//   tools/mps_testbed.sh -n 4 -- tools/nvshmem_probe/build/probe --mode coll --json out4.json
//
// Bootstrap: PE 0 makes NVSHMEM's unique id (nvshmemx_get_uniqueid) and writes it, with a run
// nonce, to $DFCCL_TESTBED_TMP/nvshmem_uid (a temporary name, then rename); the others poll for
// that file (bounded), then every PE calls nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID).  This
// is the shape of the plan's bootstrap through the key-value store (docs/design/scale-out.md §2.3),
// with a file in place of the store.
//
// Bounded waits: every host step runs under a watchdog (a phase name and a deadline; past it the
// process prints "PE p: timed out after S s in <phase>" and exits 3), and every device wait polls
// with a %globaltimer bound and an abort word the peer sets when it gives up.
//
// Measurements (rank 0 writes them as one JSON object, --json):
//  1. pingpong (PEs 0 and 1, one persistent one-warp kernel each): PE 0 puts a payload with a
//     signal (nvshmem_putmem_signal_nbi, NVSHMEM_SIGNAL_SET to the round number k) into PE 1's
//     symmetric buffer, PE 1 waits until its signal reads k (nvshmem_uint64_test in a bounded
//     loop), checks the payload and answers the same way.  Variants: put8 (8-byte payload, one
//     thread), put4k (4 KiB payload, warp-scope nvshmemx_putmem_signal_nbi_warp), signal
//     (nvshmemx_signal_op alone).  Per round trip the %globaltimer difference is kept in shared
//     memory and copied out at the end; median / p10 / p90 over --iters after --warmup.
//  2. coll (all PEs): nvshmemx_float_sum_reduce_on_stream, nvshmemx_float_fcollect_on_stream,
//     nvshmemx_float_alltoall_on_stream on NVSHMEM_TEAM_WORLD, at each --sizes (bytes of each
//     PE's input); per call: nvshmemx_barrier_all_on_stream, event, op, event; the median of
//     --coll-iters calls after --coll-warmup; the result is checked against the host's values
//     (integer-valued floats, exact sums).

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <vector>

extern char** environ;

// The NVSHMEM version of the headers compiled against (3.4 has no *_VERSION_STRING macros).
#define PROBE_STR2(x) #x
#define PROBE_STR(x) PROBE_STR2(x)
static const char* kBuiltVersion = PROBE_STR(NVSHMEM_VENDOR_MAJOR_VERSION) "." PROBE_STR(
    NVSHMEM_VENDOR_MINOR_VERSION) "." PROBE_STR(NVSHMEM_VENDOR_PATCH_VERSION);

// ------------------------------------------------------------------------------------------------
// Host utilities: log lines, the watchdog, files in the shared folder.

static int g_rank = -1, g_nproc = 0;
static std::string g_dir;

static double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static const double g_t0 = now_s();

static void logf(const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stdout, "probe[PE %d] %7.3f s: %s\n", g_rank, now_s() - g_t0, buf);
  fflush(stdout);
}

[[noreturn]] static void die(const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "probe[PE %d]: error: %s\n", g_rank, buf);
  fflush(stderr);
  fflush(stdout);
  _exit(1);
}

#define CUDA_CHECK(x)                                                                           \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) die("%s failed: %s (%s:%d)", #x, cudaGetErrorString(e_), __FILE__, __LINE__); \
  } while (0)

#define NVS_CHECK(x)                                                                            \
  do {                                                                                          \
    int s_ = (x);                                                                               \
    if (s_ != 0) die("%s returned %d (%s:%d)", #x, s_, __FILE__, __LINE__);                     \
  } while (0)

// The watchdog: a phase name and a deadline; a thread ends the process once the deadline passes.
static std::atomic<const char*> g_phase{"start"};
static std::atomic<double> g_deadline{0.0};
static std::atomic<double> g_phase_since{0.0};
static char g_phase_buf[2][256];
static int g_phase_slot = 0;

static void phase(double timeout_s, const char* fmt, ...) {
  char* b = g_phase_buf[g_phase_slot];
  g_phase_slot ^= 1;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(b, sizeof g_phase_buf[0], fmt, ap);
  va_end(ap);
  g_phase.store(b);
  g_phase_since.store(now_s());
  g_deadline.store(now_s() + timeout_s);
}

static void watchdog() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    double d = g_deadline.load();
    if (d > 0 && now_s() > d) {
      fprintf(stderr, "probe[PE %d]: timed out after %.1f s in: %s\n", g_rank,
              now_s() - g_phase_since.load(), g_phase.load());
      fflush(stderr);
      fflush(stdout);
      _exit(3);
    }
  }
}

static void write_file_atomic(const std::string& name, const void* data, size_t n) {
  std::string path = g_dir + "/" + name, tmp = path + ".tmp" + std::to_string(g_rank);
  FILE* f = fopen(tmp.c_str(), "wb");
  if (!f) die("cannot write %s: %s", tmp.c_str(), strerror(errno));
  if (fwrite(data, 1, n, f) != n) die("short write to %s", tmp.c_str());
  if (fclose(f) != 0) die("cannot close %s", tmp.c_str());
  if (rename(tmp.c_str(), path.c_str()) != 0) die("cannot rename %s: %s", tmp.c_str(), strerror(errno));
}

// Waits (bounded) for a file written by write_file_atomic and returns its bytes.
static std::string read_file_wait(const std::string& name, double timeout_s, const char* what) {
  std::string path = g_dir + "/" + name;
  double deadline = now_s() + timeout_s;
  for (;;) {
    FILE* f = fopen(path.c_str(), "rb");
    if (f) {
      std::string s;
      char buf[65536];
      size_t n;
      while ((n = fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
      fclose(f);
      return s;
    }
    if (now_s() > deadline)
      die("waited %.0f s for %s (%s) and it never came", timeout_s, what, path.c_str());
    usleep(10000);
  }
}

// A barrier through files (needs no NVSHMEM: usable before init and in any MPG mode).
static void file_barrier(const std::string& name, double timeout_s) {
  char one = '1';
  write_file_atomic("barrier." + name + "." + std::to_string(g_rank), &one, 1);
  for (int r = 0; r < g_nproc; ++r) {
    std::string what = "PE " + std::to_string(r) + " at barrier '" + name + "'";
    read_file_wait("barrier." + name + "." + std::to_string(r), timeout_s, what.c_str());
  }
}

// ------------------------------------------------------------------------------------------------
// Small JSON writer (objects and arrays of numbers and strings; enough for the report).

struct Json {
  std::string s;
  std::vector<bool> first{true};
  void sep() {
    if (!first.back()) s += ", ";
    first.back() = false;
  }
  void key(const char* k) {
    sep();
    s += "\"";
    s += k;
    s += "\": ";
    first.back() = true;  // the value that follows takes no separator
  }
  static std::string esc(const std::string& v) {
    std::string o;
    for (char c : v) {
      if (c == '"' || c == '\\') { o += '\\'; o += c; }
      else if ((unsigned char)c < 0x20) { char b[8]; snprintf(b, sizeof b, "\\u%04x", c); o += b; }
      else o += c;
    }
    return o;
  }
  void vstr(const std::string& v) { sep(); s += "\"" + esc(v) + "\""; }
  void vnum(double v) {
    sep();
    if (!std::isfinite(v)) { s += "null"; return; }
    char b[64];
    snprintf(b, sizeof b, "%.6g", v);
    s += b;
  }
  void vint(long long v) { sep(); s += std::to_string(v); }
  void vbool(bool v) { sep(); s += v ? "true" : "false"; }
  void vraw(const std::string& v) { sep(); s += v; }
  void open(char c) { sep(); s += c; first.push_back(true); }
  void close(char c) { s += c; first.pop_back(); }
  void str(const char* k, const std::string& v) { key(k); vstr(v); }
  void num(const char* k, double v) { key(k); vnum(v); }
  void integer(const char* k, long long v) { key(k); vint(v); }
  void boolean(const char* k, bool v) { key(k); vbool(v); }
  void raw(const char* k, const std::string& v) { key(k); vraw(v); }
  void obj(const char* k) { key(k); open('{'); }
  void arr(const char* k) { key(k); open('['); }
};

struct Stats {
  double median = NAN, p10 = NAN, p90 = NAN, min = NAN, max = NAN, mean = NAN;
  size_t n = 0;
};
static double pct(const std::vector<double>& sorted, double p) {  // linear interpolation (numpy's default)
  if (sorted.empty()) return NAN;
  double x = p / 100.0 * (sorted.size() - 1);
  size_t i = (size_t)x;
  double f = x - i;
  return i + 1 < sorted.size() ? sorted[i] * (1 - f) + sorted[i + 1] * f : sorted[i];
}
static Stats stats(std::vector<double> v) {
  Stats s;
  s.n = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.median = pct(v, 50);
  s.p10 = pct(v, 10);
  s.p90 = pct(v, 90);
  s.min = v.front();
  s.max = v.back();
  double t = 0;
  for (double x : v) t += x;
  s.mean = t / v.size();
  return s;
}
static void put_stats(Json& j, const char* k, const Stats& s) {
  j.obj(k);
  j.num("median_us", s.median);
  j.num("p10_us", s.p10);
  j.num("p90_us", s.p90);
  j.num("min_us", s.min);
  j.num("max_us", s.max);
  j.num("mean_us", s.mean);
  j.integer("n", (long long)s.n);
  j.close('}');
}

// ------------------------------------------------------------------------------------------------
// Device side: the ping-pong.

enum : int { kOk = 0, kNoPeer = 1, kTimeout = 2, kPeerAborted = 3, kBadValue = 4, kBadPayload = 5 };
static const char* code_name(int c) {
  switch (c) {
    case kOk: return "ok";
    case kNoPeer: return "the peer's kernel never started (start handshake)";
    case kTimeout: return "timed out waiting for the peer's signal";
    case kPeerAborted: return "the peer gave up first (its abort word)";
    case kBadValue: return "saw a signal above the one awaited";
    case kBadPayload: return "the signal came but the payload did not hold the round number";
    default: return "unknown code";
  }
}

enum : int { kVarPut8 = 0, kVarPut4k = 1, kVarSignal = 2 };
static const size_t kVarBytes[] = {8, 4096, 0};

// The symmetric block of the ping-pong (one nvshmem_malloc; offsets equal on every PE).
struct PingBlock {
  uint64_t sig;          // the round number k, set by the peer's put-with-signal / signal_op
  uint64_t pad0[15];
  uint64_t alive;        // the peer's nonce (start handshake)
  uint64_t pad1[15];
  uint64_t abort_word;   // the peer's rank + 1 when it gave up
  uint64_t pad2[15];
  uint64_t recv[512];    // payload received (4 KiB)
  uint64_t send[512];    // payload sent (source of the put: symmetric, as remote transports need)
};

__device__ __forceinline__ uint64_t gtimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t sat32(uint64_t v) { return v > 0xffffffffull ? 0xffffffffu : (uint32_t)v; }

// Lane 0 waits until *sig == want (bounded).  Returns a code; *seen holds the last value read.
__device__ int wait_signal(uint64_t* sig, uint64_t want, uint64_t* abort_word, uint64_t timeout_ns,
                           uint64_t* seen) {
  const uint64_t t0 = gtimer();
  for (uint32_t n = 1;; ++n) {
    if (nvshmem_uint64_test(sig, NVSHMEM_CMP_GE, want)) {  // test: the consistency step on success
      const uint64_t v = nvshmem_signal_fetch(sig);
      *seen = v;
      return v == want ? kOk : kBadValue;
    }
    if ((n & 63) == 0) {
      if (nvshmem_signal_fetch(abort_word) != 0) { *seen = nvshmem_signal_fetch(sig); return kPeerAborted; }
      if (gtimer() - t0 > timeout_ns) { *seen = nvshmem_signal_fetch(sig); return kTimeout; }
    }
  }
}

// One block of 32 threads on PE 0 and PE 1.  status: [0] code, [1] round (0: handshake),
// [2] value seen, [3] t_begin, [4] t_end (ns).  out: iters u32 ns per round trip.
// One message to the peer: the payload with its signal (the whole warp for put4k), or the signal alone.
__device__ void send_to_peer(PingBlock* blk, int variant, size_t bytes, uint64_t kk, int peer, int lane) {
  if (variant == kVarPut4k) {
    nvshmemx_putmem_signal_nbi_warp(blk->recv, blk->send, bytes, &blk->sig, kk, NVSHMEM_SIGNAL_SET, peer);
  } else if (lane == 0) {
    if (variant == kVarPut8) nvshmem_putmem_signal_nbi(blk->recv, blk->send, bytes, &blk->sig, kk, NVSHMEM_SIGNAL_SET, peer);
    else nvshmemx_signal_op(&blk->sig, kk, NVSHMEM_SIGNAL_SET, peer);
  }
}

// Lane 0: waits (bounded) for message kk and checks its payload's first and last words.
__device__ int receive(PingBlock* blk, size_t bytes, uint64_t kk, uint64_t timeout_ns, uint64_t* seen) {
  int code = wait_signal(&blk->sig, kk, &blk->abort_word, timeout_ns, seen);
  if (code == kOk && bytes) {
    volatile uint64_t* r = blk->recv;
    if (r[0] != kk || r[bytes / 8 - 1] != kk) { code = kBadPayload; *seen = r[0]; }
  }
  return code;
}

__global__ void pingpong_kernel(PingBlock* blk, int me, int variant, size_t bytes, uint64_t nonce, int iters,
                                uint64_t timeout_ns, uint64_t start_timeout_ns, uint32_t* out,
                                uint64_t* status) {
  extern __shared__ uint32_t smem[];
  const int lane = threadIdx.x;
  const int peer = 1 - me;
  uint64_t seen = 0;
  int code = kOk;
  if (lane == 0) {
    nvshmemx_signal_op(&blk->alive, nonce, NVSHMEM_SIGNAL_SET, peer);
    code = wait_signal(&blk->alive, nonce, &blk->abort_word, start_timeout_ns, &seen);
    if (code == kTimeout || code == kBadValue) code = kNoPeer;
  }
  code = __shfl_sync(0xffffffffu, code, 0);
  const uint64_t t_begin = gtimer();
  uint64_t t_prev = t_begin;
  int k = 1;
  for (; code == kOk && k <= iters; ++k) {
    const uint64_t kk = (uint64_t)k;
    if (me == 0) {
      uint64_t t0 = 0;
      if (lane == 0) {
        t0 = gtimer();
        if (bytes) {
          blk->send[0] = kk;
          blk->send[bytes / 8 - 1] = kk;
        }
      }
      __syncwarp();
      send_to_peer(blk, variant, bytes, kk, peer, lane);
      if (lane == 0) {
        code = receive(blk, bytes, kk, timeout_ns, &seen);
        smem[k - 1] = sat32(gtimer() - t0);
      }
    } else {
      if (lane == 0) {
        code = receive(blk, bytes, kk, timeout_ns, &seen);
        if (code == kOk && bytes) {
          blk->send[0] = kk;
          blk->send[bytes / 8 - 1] = kk;
        }
      }
      code = __shfl_sync(0xffffffffu, code, 0);
      __syncwarp();
      if (code == kOk) {
        send_to_peer(blk, variant, bytes, kk, peer, lane);
      }
      if (lane == 0) {
        const uint64_t t1 = gtimer();
        smem[k - 1] = sat32(t1 - t_prev);  // ping k-1 seen -> ping k seen
        t_prev = t1;
      }
    }
    code = __shfl_sync(0xffffffffu, code, 0);
  }
  const uint64_t t_end = gtimer();
  if (lane == 0) {
    if (code != kOk) {
      nvshmemx_signal_op(&blk->abort_word, (uint64_t)(me + 1), NVSHMEM_SIGNAL_SET, peer);
      --k;
    }
    nvshmem_quiet();
    for (int i = 0; i < iters; ++i) out[i] = smem[i];
    status[0] = (uint64_t)code;
    status[1] = code == kOk ? 0 : (uint64_t)k;
    status[2] = seen;
    status[3] = t_begin;
    status[4] = t_end;
  }
}

// The step of %globaltimer: the first n changes seen in a tight loop (as benchmarks/pingpong_mps.py).
__global__ void timer_step_kernel(uint64_t* out, int n) {
  if (threadIdx.x != 0) return;
  uint64_t last = gtimer();
  for (int i = 0, reads = 0; i < n && reads < (1 << 26); ++reads) {
    const uint64_t t = gtimer();
    if (t != last) { out[i++] = t - last; last = t; }
  }
}

// ------------------------------------------------------------------------------------------------
// Device side: inputs of the collectives.  value(pe, i) is a small integer, exact in float.

__host__ __device__ __forceinline__ float value_of(int pe, size_t i) {
  return (float)((int)((i * 7 + (size_t)pe * 1009) % 2039) + pe + 1);
}
__global__ void fill_kernel(float* p, size_t n, int pe) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = value_of(pe, i);
}

// ------------------------------------------------------------------------------------------------
// Options.

struct Opts {
  std::string json, mode = "all", dir;
  bool dry_run = false;
  int iters = 10000, warmup = 100, coll_iters = 20, coll_warmup = 5;
  double wait_timeout_s = 2.0, start_timeout_s = 30.0, boot_timeout_s = 90.0, step_timeout_s = 60.0;
  std::vector<size_t> sizes{4096, 65536, 1 << 20, 16 << 20, 64 << 20};
  std::vector<std::string> variants{"put8", "put4k", "signal"};
  std::vector<std::string> ops{"allreduce", "fcollect", "alltoall"};
};

static size_t parse_size(const std::string& s) {
  char* end = nullptr;
  double v = strtod(s.c_str(), &end);
  std::string u = end ? end : "";
  for (auto& c : u) c = (char)tolower(c);
  double m = 1;
  if (u == "k" || u == "kib") m = 1024;
  else if (u == "m" || u == "mib") m = 1024.0 * 1024;
  else if (u == "g" || u == "gib") m = 1024.0 * 1024 * 1024;
  else if (!u.empty() && u != "b") die("bad size '%s' (examples: 4096, 4K, 64M)", s.c_str());
  return (size_t)(v * m);
}
static std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> o;
  size_t a = 0;
  while (a <= s.size()) {
    size_t b = s.find(',', a);
    if (b == std::string::npos) b = s.size();
    if (b > a) o.push_back(s.substr(a, b - a));
    a = b + 1;
  }
  return o;
}

static const char* kUsage =
    "usage: probe [--json FILE] [--mode all|pingpong|coll] [--iters N] [--warmup N]\n"
    "             [--variants put8,put4k,signal] [--sizes 4K,64K,1M,16M,64M]\n"
    "             [--ops allreduce,fcollect,alltoall] [--coll-iters N] [--coll-warmup N]\n"
    "             [--wait-timeout-s S] [--start-timeout-s S] [--boot-timeout-s S] [--step-timeout-s S]\n"
    "             [--rank R --nproc N --dir DIR]   (defaults: DFCCL_TESTBED_RANK/NPROC/TMP)\n"
    "             [--dry-run]   (no GPU, no NVSHMEM: PE 0 writes the report of made-up figures)\n";

static Opts parse(int argc, char** argv) {
  Opts o;
  const char* e;
  if ((e = getenv("DFCCL_TESTBED_RANK"))) g_rank = atoi(e);
  if ((e = getenv("DFCCL_TESTBED_NPROC"))) g_nproc = atoi(e);
  if ((e = getenv("DFCCL_TESTBED_TMP"))) o.dir = e;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) die("%s needs a value\n%s", a.c_str(), kUsage);
      return argv[++i];
    };
    if (a == "--json") o.json = val();
    else if (a == "--mode") o.mode = val();
    else if (a == "--iters") o.iters = atoi(val().c_str());
    else if (a == "--warmup") o.warmup = atoi(val().c_str());
    else if (a == "--coll-iters") o.coll_iters = atoi(val().c_str());
    else if (a == "--coll-warmup") o.coll_warmup = atoi(val().c_str());
    else if (a == "--wait-timeout-s") o.wait_timeout_s = atof(val().c_str());
    else if (a == "--start-timeout-s") o.start_timeout_s = atof(val().c_str());
    else if (a == "--boot-timeout-s") o.boot_timeout_s = atof(val().c_str());
    else if (a == "--step-timeout-s") o.step_timeout_s = atof(val().c_str());
    else if (a == "--variants") o.variants = split(val());
    else if (a == "--ops") o.ops = split(val());
    else if (a == "--sizes") { o.sizes.clear(); for (auto& s : split(val())) o.sizes.push_back(parse_size(s)); }
    else if (a == "--rank") g_rank = atoi(val().c_str());
    else if (a == "--nproc") g_nproc = atoi(val().c_str());
    else if (a == "--dir") o.dir = val();
    else if (a == "--dry-run") o.dry_run = true;
    else if (a == "-h" || a == "--help") { fputs(kUsage, stdout); exit(0); }
    else die("unknown argument '%s'\n%s", a.c_str(), kUsage);
  }
  if (g_rank < 0 || g_nproc < 1 || g_rank >= g_nproc)
    die("no rank/nproc (got rank %d of %d): run under tools/mps_testbed.sh or pass --rank/--nproc", g_rank, g_nproc);
  if (o.dir.empty()) die("no shared folder: run under tools/mps_testbed.sh (DFCCL_TESTBED_TMP) or pass --dir");
  if (o.mode != "all" && o.mode != "pingpong" && o.mode != "coll") die("--mode must be all, pingpong or coll");
  if (!(o.wait_timeout_s > 0 && o.wait_timeout_s < 60)) die("--wait-timeout-s must lie in (0, 60)");
  if (o.iters < 1 || o.warmup < 0 || 4 * (size_t)(o.iters + o.warmup) > 200 * 1024)
    die("--iters + --warmup must be at most %d (their timestamps live in shared memory)", 200 * 1024 / 4);
  if (o.coll_iters < 1 || o.coll_warmup < 0) die("--coll-iters must be >= 1, --coll-warmup >= 0");
  for (auto& v : o.variants)
    if (v != "put8" && v != "put4k" && v != "signal") die("unknown variant '%s'", v.c_str());
  for (auto& v : o.ops)
    if (v != "allreduce" && v != "fcollect" && v != "alltoall") die("unknown op '%s'", v.c_str());
  for (size_t s : o.sizes)
    if (s < 4 || s % (4 * (size_t)g_nproc) != 0)
      die("size %zu: must be a multiple of 4 x nproc bytes (alltoall splits the input in nproc blocks)", s);
  g_dir = o.dir;
  return o;
}

// ------------------------------------------------------------------------------------------------
// The environment that shaped the run (recorded in the JSON).

static std::string env_json() {
  Json j;
  j.open('{');
  std::vector<std::string> names;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    static const char* prefixes[] = {"NVSHMEM_", "CUDA_MPS_", "NCCL_", "DFCCL_TESTBED_", "CUDA_VISIBLE_DEVICES",
                                     "CUDA_DEVICE_MAX_CONNECTIONS", "LD_LIBRARY_PATH"};
    for (const char* p : prefixes)
      if (kv.compare(0, strlen(p), p) == 0) { names.push_back(kv); break; }
  }
  std::sort(names.begin(), names.end());
  for (auto& kv : names) {
    size_t eq = kv.find('=');
    j.str(kv.substr(0, eq).c_str(), eq == std::string::npos ? "" : kv.substr(eq + 1));
  }
  j.close('}');
  return j.s;
}

// ------------------------------------------------------------------------------------------------
// The ping-pong.

struct PingResult {
  std::string variant;
  size_t bytes = 0;
  int code = kOk;
  Stats st;
  double mean_over_loop_us = NAN;
};

static std::vector<PingResult> run_pingpong(const Opts& o, uint64_t nonce_base, int me, cudaStream_t s,
                                            std::vector<uint64_t>* timer_steps) {
  std::vector<PingResult> res;
  const int total = o.warmup + o.iters;
  // Step of %globaltimer.
  {
    uint64_t* d;
    CUDA_CHECK(cudaMalloc(&d, 64 * sizeof(uint64_t)));
    CUDA_CHECK(cudaMemsetAsync(d, 0, 64 * sizeof(uint64_t), s));
    timer_step_kernel<<<1, 32, 0, s>>>(d, 64);
    CUDA_CHECK(cudaGetLastError());
    phase(o.step_timeout_s, "the %%globaltimer step kernel");
    CUDA_CHECK(cudaStreamSynchronize(s));
    timer_steps->resize(64);
    CUDA_CHECK(cudaMemcpy(timer_steps->data(), d, 64 * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(d));
    timer_steps->erase(std::remove(timer_steps->begin(), timer_steps->end(), 0ull), timer_steps->end());
  }
  phase(o.step_timeout_s, "nvshmem_malloc of the ping-pong block (collective over all PEs)");
  PingBlock* blk = (PingBlock*)nvshmem_malloc(sizeof(PingBlock));
  if (!blk) die("nvshmem_malloc(%zu) of the ping-pong block returned NULL", sizeof(PingBlock));
  uint32_t* d_out;
  uint64_t* d_status;
  CUDA_CHECK(cudaMalloc(&d_out, total * sizeof(uint32_t)));
  CUDA_CHECK(cudaMalloc(&d_status, 8 * sizeof(uint64_t)));
  const size_t smem = total * sizeof(uint32_t);
  CUDA_CHECK(cudaFuncSetAttribute(pingpong_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  for (size_t vi = 0; vi < o.variants.size(); ++vi) {
    const std::string& vname = o.variants[vi];
    int variant = vname == "put8" ? kVarPut8 : vname == "put4k" ? kVarPut4k : kVarSignal;
    PingResult r;
    r.variant = vname;
    r.bytes = kVarBytes[variant];
    // Fresh block: zero it, then every PE passes a barrier before any kernel runs (the peer's
    // handshake signal must not land before the zeroing).
    CUDA_CHECK(cudaMemset(blk, 0, sizeof(PingBlock)));
    CUDA_CHECK(cudaMemset(d_out, 0, total * sizeof(uint32_t)));
    CUDA_CHECK(cudaMemset(d_status, 0, 8 * sizeof(uint64_t)));
    CUDA_CHECK(cudaDeviceSynchronize());
    phase(o.step_timeout_s, "the file barrier before ping-pong '%s'", vname.c_str());
    file_barrier("pp_" + vname, o.step_timeout_s);
    if (me < 2) {
      const uint64_t nonce = nonce_base + vi + 1;
      pingpong_kernel<<<1, 32, smem, s>>>(blk, me, variant, kVarBytes[variant], nonce, total, (uint64_t)(o.wait_timeout_s * 1e9),
                                          (uint64_t)(o.start_timeout_s * 1e9), d_out, d_status);
      CUDA_CHECK(cudaGetLastError());
      phase(o.start_timeout_s + o.wait_timeout_s * 2 + o.step_timeout_s, "ping-pong '%s' kernel (%d round trips) with PE %d",
            vname.c_str(), total, 1 - me);
      CUDA_CHECK(cudaStreamSynchronize(s));
      uint64_t st[8];
      std::vector<uint32_t> ns(total);
      CUDA_CHECK(cudaMemcpy(st, d_status, sizeof st, cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(ns.data(), d_out, total * sizeof(uint32_t), cudaMemcpyDeviceToHost));
      r.code = (int)st[0];
      if (r.code != kOk) {
        std::string at = st[1] == 0 ? std::string("the start handshake") : "round trip " + std::to_string(st[1]) + " of " + std::to_string(total);
        die("ping-pong '%s' with PE %d: %s at %s (last signal value seen %llu)", vname.c_str(), 1 - me,
            code_name(r.code), at.c_str(), (unsigned long long)st[2]);
      }
      std::vector<double> us;
      for (int i = o.warmup; i < total; ++i) us.push_back(ns[i] / 1e3);
      if (me == 1 && o.warmup == 0 && !us.empty()) us.erase(us.begin());  // first interval starts at the handshake
      r.st = stats(us);
      r.mean_over_loop_us = (double)(st[4] - st[3]) / total / 1e3;
      logf("ping-pong %-6s (%4zu B): median %.3f us, p10 %.3f, p90 %.3f (mean over the loop %.3f; %s)", vname.c_str(),
           r.bytes, r.st.median, r.st.p10, r.st.p90, r.mean_over_loop_us,
           me == 0 ? "send -> answer" : "ping -> next ping");
    }
    res.push_back(r);
  }
  phase(o.step_timeout_s, "the file barrier after the ping-pong");
  file_barrier("pp_done", o.step_timeout_s);
  phase(o.step_timeout_s, "nvshmem_free of the ping-pong block (collective)");
  nvshmem_free(blk);
  CUDA_CHECK(cudaFree(d_out));
  CUDA_CHECK(cudaFree(d_status));
  return res;
}

// ------------------------------------------------------------------------------------------------
// The collectives.

struct CollResult {
  std::string op;
  size_t bytes = 0;  // each PE's input
  Stats st;          // per call, us
  bool ok = false;
  std::string check;
};

static void launch_op(const std::string& op, float* dst, const float* src, size_t nelem_in, int npes,
                      cudaStream_t s) {
  int rc = 0;
  if (op == "allreduce") rc = nvshmemx_float_sum_reduce_on_stream(NVSHMEM_TEAM_WORLD, dst, src, nelem_in, s);
  else if (op == "fcollect") rc = nvshmemx_float_fcollect_on_stream(NVSHMEM_TEAM_WORLD, dst, src, nelem_in, s);
  else rc = nvshmemx_float_alltoall_on_stream(NVSHMEM_TEAM_WORLD, dst, src, nelem_in / npes, s);
  if (rc != 0) die("nvshmemx_float_%s_on_stream returned %d", op.c_str(), rc);
}

static std::string check_result(const std::string& op, const std::vector<float>& got, size_t nelem_in, int me,
                                int npes) {
  const size_t n_out = op == "allreduce" ? nelem_in : op == "fcollect" ? nelem_in * npes : nelem_in;
  size_t bad = 0, first = (size_t)-1;
  float first_got = 0, first_want = 0;
  const size_t blk = nelem_in / npes;  // alltoall: elements per (source, destination) pair
  for (size_t i = 0; i < n_out; ++i) {
    float want;
    if (op == "allreduce") {
      double t = 0;
      for (int p = 0; p < npes; ++p) t += value_of(p, i);
      want = (float)t;
    } else if (op == "fcollect") {
      want = value_of((int)(i / nelem_in), i % nelem_in);
    } else {  // dst block p holds PE p's source block me
      want = value_of((int)(i / blk), (size_t)me * blk + i % blk);
    }
    if (got[i] != want) {
      if (bad++ == 0) { first = i; first_got = got[i]; first_want = want; }
    }
  }
  if (!bad) return "";
  char b[256];
  snprintf(b, sizeof b, "%zu of %zu elements wrong; first at %zu: got %g, want %g", bad, n_out, first, first_got,
           first_want);
  return b;
}

static std::vector<CollResult> run_collectives(const Opts& o, int me, int npes, cudaStream_t s) {
  std::vector<CollResult> res;
  size_t max_in = 0;
  for (size_t b : o.sizes) max_in = std::max(max_in, b);
  const size_t max_out = max_in * npes;  // fcollect's output
  phase(o.step_timeout_s, "nvshmem_malloc of %zu + %zu bytes for the collectives (collective over all PEs)", max_in,
        max_out);
  float* src = (float*)nvshmem_malloc(max_in);
  float* dst = (float*)nvshmem_malloc(max_out);
  if (!src || !dst)
    die("nvshmem_malloc of %zu / %zu bytes returned NULL (NVSHMEM_SYMMETRIC_SIZE too small?)", max_in, max_out);
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> host(max_out / sizeof(float));
  for (size_t bytes : o.sizes) {
    const size_t nelem = bytes / sizeof(float);
    fill_kernel<<<264, 256, 0, s>>>(src, nelem, me);
    CUDA_CHECK(cudaGetLastError());
    for (const std::string& op : o.ops) {
      CollResult r;
      r.op = op;
      r.bytes = bytes;
      const size_t out_bytes = op == "fcollect" ? bytes * npes : bytes;
      CUDA_CHECK(cudaMemsetAsync(dst, 0xff, out_bytes, s));  // NaN: a result never written fails the check
      std::vector<double> us;
      for (int it = 0; it < o.coll_warmup + o.coll_iters; ++it) {
        phase(o.step_timeout_s, "enqueueing %s of %zu bytes, call %d of %d (host side of the barrier and the op)",
              op.c_str(), bytes, it + 1, o.coll_warmup + o.coll_iters);
        nvshmemx_barrier_all_on_stream(s);
        CUDA_CHECK(cudaEventRecord(e0, s));
        launch_op(op, dst, src, nelem, npes, s);
        CUDA_CHECK(cudaEventRecord(e1, s));
        phase(o.step_timeout_s, "%s of %zu bytes, call %d of %d (waits for every PE)", op.c_str(), bytes, it + 1,
              o.coll_warmup + o.coll_iters);
        CUDA_CHECK(cudaStreamSynchronize(s));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= o.coll_warmup) us.push_back(ms * 1e3);
      }
      r.st = stats(us);
      CUDA_CHECK(cudaMemcpy(host.data(), dst, out_bytes, cudaMemcpyDeviceToHost));
      r.check = check_result(op, host, nelem, me, npes);
      r.ok = r.check.empty();
      double alg = bytes / (r.st.median * 1e-6) / 1e9;
      logf("%-9s %9zu B per PE: median %9.2f us (min %.2f, max %.2f), %7.2f GB/s algorithmic; check %s", op.c_str(),
           bytes, r.st.median, r.st.min, r.st.max, alg, r.ok ? "ok" : r.check.c_str());
      res.push_back(r);
    }
  }
  phase(o.step_timeout_s, "the barrier after the collectives");
  nvshmemx_barrier_all_on_stream(s);
  CUDA_CHECK(cudaStreamSynchronize(s));
  phase(o.step_timeout_s, "nvshmem_free of the collectives' buffers (collective)");
  nvshmem_free(dst);
  nvshmem_free(src);
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  return res;
}

// Algorithmic and bus bandwidth (the nccl-tests conventions; size: allreduce and alltoall the
// input bytes, fcollect the gathered output bytes).
static void coll_bw(const CollResult& r, int npes, double* alg_in, double* bus) {
  const double t = r.st.median * 1e-6;
  *alg_in = r.bytes / t / 1e9;
  if (r.op == "allreduce") *bus = r.bytes / t / 1e9 * 2.0 * (npes - 1) / npes;
  else if (r.op == "fcollect") *bus = (double)r.bytes * npes / t / 1e9 * (npes - 1) / npes;
  else *bus = r.bytes / t / 1e9 * (npes - 1) / npes;
}

// One PE's results as JSON (rank 0 gathers every PE's through the shared folder).
static std::string pe_json(int me, const std::vector<PingResult>& pp, const std::vector<CollResult>& cr, int npes) {
  Json j;
  j.open('{');
  j.integer("pe", me);
  j.arr("pingpong");
  for (auto& r : pp) {
    if (r.st.n == 0) continue;
    j.open('{');
    j.str("variant", r.variant);
    j.integer("payload_bytes", (long long)r.bytes);
    j.str("what", me == 0 ? "send -> answer seen (round trip)" : "ping k-1 seen -> ping k seen (one round trip)");
    put_stats(j, "globaltimer", r.st);
    j.num("mean_over_loop_us", r.mean_over_loop_us);
    j.close('}');
  }
  j.close(']');
  j.arr("collectives");
  for (auto& r : cr) {
    double alg, bus;
    coll_bw(r, npes, &alg, &bus);
    j.open('{');
    j.str("op", r.op);
    j.integer("bytes_per_pe_in", (long long)r.bytes);
    put_stats(j, "per_call", r.st);
    j.num("algbw_GBps", alg);
    j.num("busbw_GBps", bus);
    j.boolean("check_ok", r.ok);
    if (!r.ok) j.str("check", r.check);
    j.close('}');
  }
  j.close(']');
  j.close('}');
  return j.s;
}

// ------------------------------------------------------------------------------------------------

struct RunInfo {
  int npes = 0, n_same_gpu = 0, sm_count = 0, driver = 0, runtime = 0;
  std::string lib_name, spec_version, status_name, device, skipped;
  double init_s = NAN;
  std::vector<uint64_t> timer_steps;
  bool dry_run = false;
};

// PE 0's report: the JSON document (--json) and the SUMMARY lines.
static void report(const Opts& o, const RunInfo& info, const std::vector<PingResult>& pp,
                   const std::vector<CollResult>& cr, const std::string& mine, const std::vector<std::string>& peers,
                   bool all_ok) {
  Json j;
  j.open('{');
  j.str("benchmark", "nvshmem_probe");
  j.str("mode", o.mode);
  j.integer("npes", info.npes);
  j.integer("pes_on_this_gpu", info.n_same_gpu);
  j.str("nvshmem_built_against", kBuiltVersion);
  if (info.dry_run) j.boolean("dry_run", true);
  j.str("nvshmem_library_name", info.lib_name);
  j.str("nvshmem_spec_version", info.spec_version);
  j.str("init_status", info.status_name);
  j.num("init_s", info.init_s);
  j.str("bootstrap", "NVSHMEMX_INIT_WITH_UNIQUEID, the id through a file in DFCCL_TESTBED_TMP");
  j.str("device", info.device);
  j.integer("sm_count", info.sm_count);
  j.integer("cuda_driver", info.driver);
  j.integer("cuda_runtime", info.runtime);
  j.raw("env", env_json());
  j.integer("iters", o.iters);
  j.integer("warmup", o.warmup);
  j.integer("coll_iters", o.coll_iters);
  j.integer("coll_warmup", o.coll_warmup);
  j.num("wait_timeout_s", o.wait_timeout_s);
  if (!info.timer_steps.empty()) {
    std::vector<uint64_t> t = info.timer_steps;
    std::sort(t.begin(), t.end());
    j.obj("globaltimer_step_ns");
    j.integer("min", (long long)t.front());
    j.integer("median", (long long)t[t.size() / 2]);
    j.close('}');
  }
  j.str("pingpong_what",
        "PE 0: per round trip, %globaltimer from the put-with-signal (or signal_op) to PE 1 until PE 1's answer "
        "is seen in PE 0's signal word; one-warp persistent kernels, PE 0 and PE 1, symmetric heap on one GPU");
  j.str("collectives_what",
        "per call: nvshmemx_barrier_all_on_stream, event, nvshmemx_float_<op>_on_stream(NVSHMEM_TEAM_WORLD), "
        "event; median of coll_iters after coll_warmup; bytes_per_pe_in is each PE's input (alltoall: nproc blocks "
        "of bytes/nproc); busbw as nccl-tests (allreduce x 2(n-1)/n; fcollect of n x bytes and alltoall x (n-1)/n)");
  j.str("skipped", info.skipped);
  j.boolean("all_checks_ok", all_ok);
  j.raw("pe0", mine);
  j.arr("peers");
  for (auto& p : peers) j.vraw(p);
  j.close(']');
  j.close('}');
  if (!o.json.empty()) {
    FILE* f = fopen(o.json.c_str(), "w");
    if (!f) die("cannot write %s: %s", o.json.c_str(), strerror(errno));
    fputs(j.s.c_str(), f);
    fputc('\n', f);
    fclose(f);
    logf("wrote %s", o.json.c_str());
  }
  // Summary lines.
  for (auto& r : pp)
    if (r.st.n)
      printf("SUMMARY pingpong %-6s %4zu B: median %.3f us (p10 %.3f, p90 %.3f) over %zu round trips, %d PEs, %s\n",
             r.variant.c_str(), r.bytes, r.st.median, r.st.p10, r.st.p90, r.st.n, info.npes, info.status_name.c_str());
  for (auto& r : cr) {
    double alg, bus;
    coll_bw(r, info.npes, &alg, &bus);
    printf("SUMMARY coll %-9s %9zu B/PE: %9.2f us, algbw %7.2f GB/s, busbw %7.2f GB/s, %d PEs, check %s\n",
           r.op.c_str(), r.bytes, r.st.median, alg, bus, info.npes, r.ok ? "ok" : "FAILED");
  }
  fflush(stdout);
}

int main(int argc, char** argv) {
  Opts o = parse(argc, argv);
  std::thread(watchdog).detach();
  logf("rank %d of %d, shared folder %s, mode %s; built against NVSHMEM %s", g_rank, g_nproc, g_dir.c_str(),
       o.mode.c_str(), kBuiltVersion);

  if (o.dry_run) {  // the report's code paths without a GPU (made-up figures, marked dry_run)
    RunInfo info;
    info.dry_run = true;
    info.npes = g_nproc;
    info.status_name = "dry run";
    info.device = "none";
    std::vector<PingResult> pp;
    std::vector<CollResult> cr;
    if (o.mode != "coll")
      for (auto& v : o.variants) {
        PingResult r;
        r.variant = v;
        r.bytes = v == "put8" ? 8 : v == "put4k" ? 4096 : 0;
        r.st = stats({1.5, 1.6, 1.7});
        r.mean_over_loop_us = 1.6;
        pp.push_back(r);
      }
    if (o.mode != "pingpong")
      for (size_t b : o.sizes)
        for (auto& op : o.ops) {
          CollResult r;
          r.op = op;
          r.bytes = b;
          r.st = stats({10.0, 11.0, 12.0});
          // The check itself, against a host model of the op (NVSHMEM's semantics: fcollect
          // dest[p*n + i] = src_p[i]; alltoall dest block p on PE me = src_p block me).
          const size_t n = std::min<size_t>(b / sizeof(float), 1 << 16);
          const size_t n_out = op == "fcollect" ? n * g_nproc : n, blk = n / g_nproc;
          r.ok = true;
          for (int me = 0; me < g_nproc && r.ok; ++me) {
            std::vector<float> got(n_out);
            for (size_t i = 0; i < n_out; ++i) {
              if (op == "allreduce") { float t = 0; for (int q = 0; q < g_nproc; ++q) t += value_of(q, i); got[i] = t; }
              else if (op == "fcollect") got[i] = value_of((int)(i / n), i % n);
              else got[i] = value_of((int)(i / blk), me * blk + i % blk);
            }
            r.check = check_result(op, got, n, me, g_nproc);
            got[n_out / 2] += 1;  // and a wrong element is caught
            if (!r.check.empty() || check_result(op, got, n, me, g_nproc).empty()) r.ok = false;
          }
          if (!r.ok) die("dry run: the check of %s disagrees with its host model: %s", op.c_str(), r.check.c_str());
          cr.push_back(r);
        }
    std::vector<std::string> peers;
    for (int p = 1; p < g_nproc; ++p) peers.push_back(pe_json(p, {}, cr, g_nproc));
    if (g_rank == 0) report(o, info, pp, cr, pe_json(0, pp, cr, g_nproc), peers, true);
    return 0;
  }

  phase(o.step_timeout_s, "cudaSetDevice(0) and the CUDA context (MPS client start)");
  CUDA_CHECK(cudaSetDevice(0));
  CUDA_CHECK(cudaFree(nullptr));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);

  // Bootstrap by unique id through a file.
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  uint64_t nonce = 0;
  struct UidFile {
    uint64_t magic;
    uint64_t nonce;
    uint32_t uid_size;
    uint32_t pad;
    unsigned char uid[sizeof(nvshmemx_uniqueid_t)];
  } uf;
  const uint64_t kMagic = 0x31646975766e7370ull;  // "psnvuid1"
  if (g_rank == 0) {
    phase(o.step_timeout_s, "nvshmemx_get_uniqueid (loads the UID bootstrap plugin, opens its socket)");
    NVS_CHECK(nvshmemx_get_uniqueid(&uid));
    std::random_device rd;
    nonce = ((uint64_t)rd() << 32 | rd()) & 0x0000ffffffffff00ull;
    memset(&uf, 0, sizeof uf);
    uf.magic = kMagic;
    uf.nonce = nonce;
    uf.uid_size = sizeof uid;
    memcpy(uf.uid, &uid, sizeof uid);
    write_file_atomic("nvshmem_uid", &uf, sizeof uf);
    logf("wrote the unique id (%zu bytes) to %s/nvshmem_uid", sizeof uid, g_dir.c_str());
  } else {
    phase(o.boot_timeout_s + 5, "waiting for PE 0's unique id file");
    std::string b = read_file_wait("nvshmem_uid", o.boot_timeout_s, "PE 0's unique id file");
    if (b.size() != sizeof uf) die("unique id file has %zu bytes, want %zu (another NVSHMEM version on PE 0?)", b.size(), sizeof uf);
    memcpy(&uf, b.data(), sizeof uf);
    if (uf.magic != kMagic || uf.uid_size != sizeof uid) die("unique id file: bad magic or size");
    memcpy(&uid, uf.uid, sizeof uid);
    nonce = uf.nonce;
  }
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  NVS_CHECK(nvshmemx_set_attr_uniqueid_args(g_rank, g_nproc, &uid, &attr));
  phase(o.boot_timeout_s, "nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID) with %d PEs (waits for every PE)", g_nproc);
  const double t_init = now_s();
  int irc = nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  if (irc != 0) die("nvshmemx_init_attr returned %d", irc);
  const double init_s = now_s() - t_init;
  const int me = nvshmem_my_pe(), npes = nvshmem_n_pes();
  if (me != g_rank || npes != g_nproc) die("NVSHMEM says PE %d of %d, the testbed rank %d of %d", me, npes, g_rank, g_nproc);
  const int status = nvshmemx_init_status();
  const char* status_name = status == NVSHMEM_STATUS_FULL_MPG      ? "FULL_MPG"
                            : status == NVSHMEM_STATUS_LIMITED_MPG ? "LIMITED_MPG"
                            : status == NVSHMEM_STATUS_IS_INITIALIZED ? "INITIALIZED (one PE per GPU)"
                                                                    : "other";
  int vmaj = 0, vmin = 0;
  nvshmem_info_get_version(&vmaj, &vmin);
  char vname[NVSHMEM_MAX_NAME_LEN];
  memset(vname, 0, sizeof vname);
  nvshmem_info_get_name(vname);
  const int n_same_gpu = nvshmem_team_n_pes(NVSHMEMI_TEAM_SAME_GPU);
  logf("nvshmem initialised in %.2f s: PE %d of %d, %d PE(s) on this GPU, init status %s (%d); library '%s', spec %d.%d",
       init_s, me, npes, n_same_gpu, status_name, status, vname, vmaj, vmin);

  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<PingResult> pp;
  std::vector<CollResult> cr;
  std::vector<uint64_t> timer_steps;
  std::string skipped;
  if ((o.mode == "all" || o.mode == "pingpong")) {
    if (npes < 2) skipped += "pingpong: needs 2 PEs; ";
    else pp = run_pingpong(o, nonce, me, s, &timer_steps);
  }
  if (o.mode == "all" || o.mode == "coll") {
    if (status == NVSHMEM_STATUS_LIMITED_MPG) {
      // NVSHMEM exits in its collectives in a limited-MPG run: say why instead.
      logf("collectives skipped: NVSHMEM runs in LIMITED_MPG (MPS not detected by NVSHMEM, or the PEs' "
           "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE add up to more than 100 and NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "
           "is not set); its collectives are not supported there");
      skipped += "collectives: LIMITED_MPG; ";
    } else {
      cr = run_collectives(o, me, npes, s);
    }
  }

  RunInfo info;
  info.npes = npes;
  info.n_same_gpu = n_same_gpu;
  info.sm_count = prop.multiProcessorCount;
  info.driver = drv;
  info.runtime = rt;
  info.lib_name = vname;
  info.spec_version = std::to_string(vmaj) + "." + std::to_string(vmin);
  info.status_name = status_name;
  info.device = prop.name;
  info.skipped = skipped;
  info.init_s = init_s;
  info.timer_steps = timer_steps;

  // Gather every PE's results at PE 0.
  std::string mine = pe_json(me, pp, cr, npes);
  phase(o.step_timeout_s + 5, "writing / gathering the results");
  if (me != 0) write_file_atomic("result." + std::to_string(me), mine.data(), mine.size());
  bool all_ok = true;
  for (auto& r : cr) all_ok = all_ok && r.ok;
  if (me == 0) {
    std::vector<std::string> peers;
    for (int p = 1; p < npes; ++p) {
      std::string what = "PE " + std::to_string(p) + "'s results";
      peers.push_back(read_file_wait("result." + std::to_string(p), o.step_timeout_s, what.c_str()));
      all_ok = all_ok && peers.back().find("\"check_ok\": false") == std::string::npos;
    }
    report(o, info, pp, cr, mine, peers, all_ok);
    fflush(stdout);
  }
  phase(o.step_timeout_s, "the file barrier before nvshmem_finalize");
  file_barrier("finalize", o.step_timeout_s);
  phase(o.step_timeout_s, "nvshmem_finalize");
  CUDA_CHECK(cudaStreamDestroy(s));
  nvshmem_finalize();
  g_deadline.store(0);
  if (!all_ok) die("a collective's result differs from the expected values (see the lines above)");
  logf("done");
  return 0;
}
