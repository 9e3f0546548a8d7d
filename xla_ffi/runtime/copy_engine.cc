// The mover: readiness polling and the issue of copy-engine collectives
// (protocol in copy_engine.h).
#include "runtime/copy_engine.h"
#include "dfccl/host.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <sstream>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "runtime/driver.h"

namespace dfccl::gpu {
namespace {

#define DFCCL_CE(call) DFCCL_CHECK_CUDA(call, "dfccl: copy engine")

// [off, off+len) pieces of a byte range cut into at most kMaxChunks chunks of
// at least chunk_bytes (whole elements).
std::vector<std::pair<int64_t, int64_t>> Chunks(int64_t bytes, int64_t chunk_bytes, int64_t elem) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (bytes <= 0) return out;
  int64_t per = std::max<int64_t>(chunk_bytes, (bytes + CopyEngine::kMaxChunks - 1) / CopyEngine::kMaxChunks);
  per = (per + elem - 1) / elem * elem;
  for (int64_t off = 0; off < bytes; off += per) out.emplace_back(off, std::min(per, bytes - off));
  return out;
}

}  // namespace

void CopyEngine::Submit(CeOp op) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] {
      NameThisThread("dfccl-copy");
      Loop();
    });
    pending_.push_back(std::move(op));
  }
  cv_.notify_one();
}

bool CopyEngine::Cancel(const void* comm, uint64_t key_hash, uint64_t seq) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->comm == comm && it->key_hash == key_hash && it->seq == seq) {
      pending_.erase(it);
      return true;
    }
  }
  return false;
}

bool CopyEngine::Pending(const void* comm, uint64_t key_hash, uint64_t seq) {
  std::lock_guard<std::mutex> lk(mu_);
  for (const CeOp& op : pending_)
    if (op.comm == comm && op.key_hash == key_hash && op.seq == seq) return true;
  return false;
}

std::string CopyEngine::error() {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

void CopyEngine::Stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

bool CopyEngine::Ready(const CeOp& op) {
  for (const CeRank& r : op.ranks)
    if (static_cast<int32_t>(*r.ready - r.gen) < 0) return false;
  return true;
}

// Spins while instances wait for their inputs (an XLA stream reaches its ready
// write within microseconds in a busy program), yields the core after a
// while, and sleeps on the condition variable when nothing is pending.
void CopyEngine::Loop() {
  using Clock = std::chrono::steady_clock;
  auto last_issue = Clock::now();
  std::vector<CeOp> batch;
  while (true) {
    CeSettings s;
    {
      std::unique_lock<std::mutex> lk(mu_);
      phase_ = kSleeping;
      cv_.wait(lk, [&] { return stop_ || !pending_.empty(); });
      phase_ = kPolling;
      if (stop_) return;
      s = settings_;
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (Ready(*it)) { batch.push_back(std::move(*it)); it = pending_.erase(it); }
        else ++it;
      }
    }
    phase_ = kTimers;
    ReadTimers();
    phase_ = kPolling;
    if (batch.empty()) {
      if (Clock::now() - last_issue > std::chrono::milliseconds(20)) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else std::this_thread::yield();
      continue;
    }
    for (const CeOp& op : batch) {
      const auto t0 = Clock::now();
      phase_key_ = op.key_hash;
      phase_seq_ = op.seq;
      phase_ = kIssuing;
      try {
        Issue(op, s);
      } catch (const std::exception& ex) {
        {
          std::lock_guard<std::mutex> lk(mu_);
          if (error_.empty()) error_ = ex.what();
        }
        for (const CeRank& r : op.ranks) *r.done_host = r.gen;  // the error reaches the program
                                                                  // at its next collective
      }
      issued_++;
      issue_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    }
    batch.clear();
    last_issue = Clock::now();
  }
}

std::string CopyEngine::Describe() {
  static const char* kPhase[] = {"not started", "asleep (nothing submitted)", "polling the ready words",
                                 "reading its timers", "enqueuing"};
  std::ostringstream os;
  const int ph = phase_;
  os << "mover " << kPhase[ph];
  if (ph == kIssuing) os << " key hash " << phase_key_ << " seq " << phase_seq_;
  os << ", " << issued_ << " issued";
  std::unique_lock<std::mutex> lk(mu_, std::defer_lock);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  while (!lk.try_lock()) {
    if (std::chrono::steady_clock::now() >= until) return os.str() + ", its lock is held";
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  os << ", " << pending_.size() << " waiting for inputs";
  for (const CeOp& op : pending_) {
    os << "; key hash " << op.key_hash << " seq " << op.seq << " ready [";
    for (size_t r = 0; r < op.ranks.size(); ++r)
      os << (r ? " " : "") << (static_cast<int32_t>(*op.ranks[r].ready - op.ranks[r].gen) >= 0 ? "y" : "n");
    os << "]";
  }
  if (!error_.empty()) os << "; error: " << error_;
  return os.str();
}

// Streams and events are created here, from the runtime's device setup, never
// by the mover: creating them takes a context-wide driver lock, and a thread
// blocked inside a launch on a full XLA stream holds that lock until the GPU
// drains the stream - which waits for the very copies the mover would issue.
void CopyEngine::Prepare(int ordinal) {
  std::lock_guard<std::mutex> lk(devs_mu_);
  if (devs_.count(ordinal)) return;
  DeviceGuard guard(ordinal);
  Dev& d = devs_[ordinal];
  for (cudaStream_t* s : {&d.pull, &d.pull2, &d.comp}) DFCCL_CE(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
  for (int c = 0; c < kMaxChunks; ++c) {
    DFCCL_CE(cudaEventCreateWithFlags(&d.pulled[c], cudaEventDisableTiming));
    DFCCL_CE(cudaEventCreateWithFlags(&d.reduced[c], cudaEventDisableTiming));
  }
  for (int t = 0; t < Dev::kTimers; ++t) {
    DFCCL_CE(cudaEventCreate(&d.t0[t]));
    DFCCL_CE(cudaEventCreate(&d.t1[t]));
  }
  DFCCL_CE(cudaEventCreateWithFlags(&d.joined, cudaEventDisableTiming));
  DFCCL_CE(cudaEventCreateWithFlags(&d.fin, cudaEventDisableTiming));
}

CopyEngine::Dev& CopyEngine::GetDev(int ordinal) {
  std::lock_guard<std::mutex> lk(devs_mu_);
  auto it = devs_.find(ordinal);
  DFCCL_CHECK(it != devs_.end(), "dfccl: copy engine: GPU " << ordinal << " was not prepared");
  return it->second;  // std::map: stays valid while other devices are added
}

void CopyEngine::ReadTimers() {
  std::lock_guard<std::mutex> lk(devs_mu_);
  for (auto& [ord, d] : devs_) {
    while (!d.timing.empty()) {
      const int t = d.timing.front();
      if (cudaEventQuery(d.t1[t]) != cudaSuccess) break;
      float ms = 0;
      if (cudaEventElapsedTime(&ms, d.t0[t], d.t1[t]) == cudaSuccess) {
        gpu_ns_ += static_cast<int64_t>(ms * 1e6);
        timed_++;
      }
      d.timing.pop_front();
    }
    cudaGetLastError();
  }
}

// Every rank's work is enqueued in phases across ranks, so that an event a
// rank waits on (a peer's reduced chunk, a peer's finish) is always recorded
// before the wait is enqueued.
void CopyEngine::Issue(const CeOp& op, const CeSettings& s) {
  const int n = static_cast<int>(op.ranks.size());
  const int64_t B = op.elems * op.elem_bytes;
  std::vector<Dev*> dv(n);
  for (int r = 0; r < n; ++r) dv[r] = &GetDev(op.ranks[r].ordinal);
  auto on = [&](int r) { DFCCL_CE(cudaSetDevice(op.ranks[r].ordinal)); return dv[r]; };
  auto copy = [](cudaStream_t st, void* dst, const void* src, int64_t bytes) {
    if (bytes > 0 && dst != src) DFCCL_CE(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st));
  };
  // The range of rank r's output that it reduces itself (all-reduce: its segment; reduce-scatter: all of it).
  const int64_t seg = op.kind == OpKind::kAllReduce ? ((op.elems + n - 1) / n + 7) / 8 * 8 * op.elem_bytes : B;
  auto seg_of = [&](int r) -> std::pair<int64_t, int64_t> {
    if (op.kind != OpKind::kAllReduce) return {0, B};
    const int64_t lo = std::min<int64_t>(r * seg, B);
    return {lo, std::min<int64_t>(lo + seg, B) - lo};
  };
  // Reductions: where rank r's range starts in the inputs and in its output, and its chunks.
  struct Range { int64_t in_off, out_off; std::vector<std::pair<int64_t, int64_t>> chunks; };
  auto range_of = [&](int r) {
    const auto [lo, len] = seg_of(r);
    const bool rs = op.kind == OpKind::kReduceScatter;
    return Range{rs ? r * B : lo, rs ? 0 : lo, Chunks(len, s.chunk_bytes, op.elem_bytes)};
  };
  // Rank 0's part is timed (first copy .. done write) while a timer is free.
  int timer = -1;
  if (dv[0]->timing.size() < static_cast<size_t>(Dev::kTimers)) {
    timer = dv[0]->timer_head;
    dv[0]->timer_head = (timer + 1) % Dev::kTimers;
  }
  // Phase 1: the transfers, on the stream `pull` of the rank whose engines run them (the
  // receiver when pulling, the sender when pushing), then the local copies.  `move(dst_rank,
  // src_rank, ...)` enqueues one transfer and returns the rank whose stream holds it.
  auto engine_of = [&](int dst_r, int src_r) { return s.push ? src_r : dst_r; };  // whose engines move the data
  auto move = [&](int dst_r, int src_r, int64_t dst_off, int64_t src_off, int64_t bytes) {
    const int by = engine_of(dst_r, src_r);
    copy(on(by)->pull, op.ranks[dst_r].out + dst_off, op.ranks[src_r].in + src_off, bytes);
    return by;
  };
  for (int r = 0; r < n; ++r) {
    const CeRank& me = op.ranks[r];
    if (r == 0 && timer >= 0) DFCCL_CE(cudaEventRecord(dv[0]->t0[timer], on(0)->pull));
    switch (op.kind) {
      case OpKind::kAllGather:  // rank r receives every peer's input at out[p]
        for (int k = 1; k < n; ++k) { const int p = (r + k) % n; move(r, p, p * B, 0, B); }
        copy(on(r)->comp, me.out + r * B, me.in, B);
        break;
      case OpKind::kAllToAll:  // ... every peer's block r at out[p]
        for (int k = 1; k < n; ++k) { const int p = (r + k) % n; move(r, p, p * B, r * B, B); }
        copy(on(r)->comp, me.out + r * B, me.in + r * B, B);
        break;
      case OpKind::kPermute:
        if (me.recv_from >= 0) move(r, me.recv_from, 0, 0, B);
        else DFCCL_CE(cudaMemsetAsync(me.out, 0, B, on(r)->comp));
        break;
      case OpKind::kReduceScatter:
      case OpKind::kAllReduce: {  // the peer's operand of rank r's range arrives in r's output, chunk by chunk
        const int p = 1 - r;      // Supports(): 2 ranks
        const Range g = range_of(r);
        for (size_t c = 0; c < g.chunks.size(); ++c) {
          const int by = move(r, p, g.out_off + g.chunks[c].first, g.in_off + g.chunks[c].first, g.chunks[c].second);
          DFCCL_CE(cudaEventRecord(dv[by]->pulled[c], on(by)->pull));  // an event of the moving device
        }
        break;
      }
    }
  }
  // Reductions: each rank folds the arrived chunks into its output (a chunk's event was
  // recorded above by the device that moved it: the peer when pushing).
  if (op.kind == OpKind::kReduceScatter || op.kind == OpKind::kAllReduce) {
    for (int r = 0; r < n; ++r) {
      const CeRank& me = op.ranks[r];
      const int by = engine_of(r, 1 - r);
      Dev* d = on(r);
      const Range g = range_of(r);
      for (size_t c = 0; c < g.chunks.size(); ++c) {
        const auto [o, l] = g.chunks[c];
        DFCCL_CE(cudaStreamWaitEvent(d->comp, dv[by]->pulled[c], 0));
        DFCCL_CE(LaunchReduceInto(d->comp, op.dtype, op.reduce, me.out + g.out_off + o, me.in + g.in_off + o, l,
                                  s.reduce_blocks));
        DFCCL_CE(cudaEventRecord(dv[r]->reduced[c], d->comp));
      }
    }
  }
  // Phase 2 (all-reduce): rank r's output receives the peer's reduced segment, chunk by chunk as it is reduced.
  if (op.kind == OpKind::kAllReduce) {
    for (int r = 0; r < n; ++r) {
      const int p = 1 - r;
      const int by = engine_of(r, p);
      Dev* d = on(by);
      const auto [lo, len] = seg_of(p);
      const auto chunks = Chunks(len, s.chunk_bytes, op.elem_bytes);
      for (size_t c = 0; c < chunks.size(); ++c) {
        DFCCL_CE(cudaStreamWaitEvent(d->pull2, dv[p]->reduced[c], 0));
        copy(d->pull2, op.ranks[r].out + lo + chunks[c].first, op.ranks[p].out + lo + chunks[c].first, chunks[c].second);
      }
    }
  }
  // Join each rank's streams into `pull`, record its finish ...
  for (int r = 0; r < n; ++r) {
    Dev* d = on(r);
    const bool used_comp = op.kind != OpKind::kPermute || op.ranks[r].recv_from < 0;
    const bool used_pull2 = op.kind == OpKind::kAllReduce;
    for (cudaStream_t st : {d->comp, d->pull2}) {
      if ((st == d->comp && !used_comp) || (st == d->pull2 && !used_pull2)) continue;
      DFCCL_CE(cudaEventRecord(dv[r]->joined, st));
      DFCCL_CE(cudaStreamWaitEvent(d->pull, dv[r]->joined, 0));
    }
    DFCCL_CE(cudaEventRecord(dv[r]->fin, d->pull));
  }
  // ... and release its XLA stream once every peer is done reading its buffers.
  for (int r = 0; r < n; ++r) {
    Dev* d = on(r);
    for (int p = 0; p < n; ++p)
      if (p != r) DFCCL_CE(cudaStreamWaitEvent(d->pull, dv[p]->fin, 0));
    if (r == 0 && timer >= 0) {
      DFCCL_CE(cudaEventRecord(dv[0]->t1[timer], d->pull));
      dv[0]->timing.push_back(timer);
    }
    StreamOps::Write32(d->pull, op.ranks[r].done, op.ranks[r].gen);
  }
}

}  // namespace dfccl::gpu
