// The CPU backend across processes: see multiprocess.h (roles) and shm.h (protocol).
#include "cpu/multiprocess.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "cpu/daemon.h"
#include "dfccl/host.h"
#include "cpu/collectives.h"
#include "cpu/shm.h"
#include "dfccl/check.h"
#include "dfccl/execution.h"

namespace dfccl::cpu {
namespace {

constexpr int64_t kLivenessPeriodNs = 5'000'000;  // liveness checks of missing ranks' processes
// A start moves past at most this many entries of executions its process left behind (one per failed
// execution of the program whose peers had started the key; dfccl/execution.h).
constexpr int kMaxSkips = kRunWindow;

struct Staged {
  int32_t entry;
  uint32_t gen;
  int64_t offset, bytes;
};

struct World {
  std::mutex mu;  // guards everything below but `table` (set once, before use)
  std::atomic<bool> attached{false};
  shm::Table* table = nullptr;
  int32_t me = -1;
  std::vector<char*> arenas;  // by process
  std::unordered_map<int64_t, int32_t> device_proc;
  std::unordered_map<std::string, std::pair<void*, size_t>> own;  // created segments
  // This process's arena allocator: free blocks by offset (first fit, coalescing).
  std::map<int64_t, int64_t> free_blocks;
  int64_t arena_bytes = 0, staged_bytes = 0;
  std::vector<Staged> staged;
};

World& W() {
  static World* w = new World;  // leaked: daemon threads may use it during exit
  return *w;
}

// Caller holds W().mu.
void FreeBlockLocked(World& w, int64_t off, int64_t bytes) {
  w.staged_bytes -= bytes;
  auto it = w.free_blocks.emplace(off, bytes).first;
  if (auto next = std::next(it); next != w.free_blocks.end() && it->first + it->second == next->first) {
    it->second += next->second;
    w.free_blocks.erase(next);
  }
  if (it != w.free_blocks.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      w.free_blocks.erase(it);
    }
  }
}

void ReclaimLocked(World& w) {
  std::erase_if(w.staged, [&](const Staged& s) {
    if (!w.table->Reclaimable(s.entry, s.gen)) return false;
    FreeBlockLocked(w, s.offset, s.bytes);
    return true;
  });
}

int64_t AllocLocked(World& w, int64_t bytes) {
  for (auto it = w.free_blocks.begin(); it != w.free_blocks.end(); ++it) {
    if (it->second < bytes) continue;
    const int64_t off = it->first, rest = it->second - bytes;
    w.free_blocks.erase(it);
    if (rest > 0) w.free_blocks.emplace(off + bytes, rest);
    w.staged_bytes += bytes;
    return off;
  }
  return -1;
}

int32_t ProcOf(const World& w, int64_t device) {
  auto it = w.device_proc.find(device);
  return it == w.device_proc.end() ? -1 : it->second;
}

// Every process with a rank in the entry may now progress.
void RingGroup(const World& w, const shm::Entry& en) {
  std::vector<int32_t> procs;
  for (int r = 0; r < en.n; ++r) procs.push_back(ProcOf(w, en.devices[r]));
  std::sort(procs.begin(), procs.end());
  procs.erase(std::unique(procs.begin(), procs.end()), procs.end());
  for (int32_t p : procs) {
    if (p == w.me)
      WakeAllDaemons();  // our own daemons: directly, not through the bell thread
    else if (p >= 0)
      w.table->Ring(p);
  }
}

std::string RankName(const World& w, const shm::Entry& en, int r) {
  std::ostringstream os;
  const int32_t p = ProcOf(w, en.devices[r]);
  os << r << " (device " << en.devices[r] << ", process " << p << ")";
  return os.str();
}

// "" if process p is alive; else why not.
std::string ProcessGone(World& w, int32_t p) {
  if (p < 0) return "";
  shm::Proc& pr = w.table->proc(p);
  const int32_t pid = pr.pid.load(std::memory_order_acquire);
  if (pr.state.load(std::memory_order_acquire) == shm::kProcExited) return "exited";
  if (pid > 0 && !shm::ProcessAlive(pid)) return "died (pid " + std::to_string(pid) + ")";
  return "";
}

void CompleteFromTable(Task& t) {
  int32_t kind = 0;
  std::string err;
  if (W().table->TakeFailure(t.shm->entry, t.shm->gen, &kind, &err))
    t.Complete(static_cast<ErrorCode>(kind), err);
}

void BellLoop(World* w) {
  for (;;) {
    const uint32_t seen = w->table->proc(w->me).bell.load(std::memory_order_acquire);
    w->table->WaitBell(w->me, seen, 50'000);
    if (w->table->proc(w->me).bell.load(std::memory_order_acquire) != seen) WakeAllDaemons();
  }
}

}  // namespace

bool CrossProcess(const CollectiveSpec& spec) {
  World& w = W();
  if (!w.attached.load(std::memory_order_acquire)) return false;
  for (int64_t d : spec.group_devices) {
    const int32_t p = ProcOf(w, d);
    if (p >= 0 && p != w.me) return true;
  }
  return false;
}

// A group spanning processes: the sequence number is counted here as for any
// group; matching and data go through shared memory (multiprocess.h).
int64_t StartCrossProcess(const std::shared_ptr<Task>& task) {
  const CollectiveSpec& spec = task->spec;
  auto inst = std::make_shared<Instance>();  // local shell, for messages
  inst->key_hash = spec.key_hash;
  inst->key = spec.key;
  inst->n = spec.nranks;
  inst->slots.resize(spec.nranks);
  {
    std::lock_guard<std::mutex> l(task->comm->mu);
    auto& cnt = task->comm->counters[spec.key_hash];
    if (cnt.empty()) cnt.assign(spec.nranks, 0);
    task->seq = inst->seq = cnt[spec.rank]++;
  }
  task->inst = inst;
  TraceEvent(spec.self_device, spec.key, task->seq, "start");
  ErrorCode kind = ErrorCode::kOk;
  std::string msg;
  bool ok = false;
  try {
    ok = ShmStart(*task, &kind, &msg);
  } catch (...) {
    task->Complete(ErrorCode::kInternal, "dfccl: collective '" + spec.key + "' failed to start");
    throw;
  }
  RegisterTicket(task);
  if (ok)
    task->daemon->Submit(task, /*urgent=*/ShmReady(*task));
  else
    task->Complete(kind, msg);
  return task->ticket;
}

bool ShmStart(Task& t, ErrorCode* kind, std::string* error) {
  World& w = W();
  const CollectiveSpec& s = t.spec;
  const int64_t bytes = (s.in_bytes() + 63) & ~int64_t{63};
  int64_t off = 0;
  if (bytes > 0) {
    std::lock_guard<std::mutex> l(w.mu);
    ReclaimLocked(w);
    off = AllocLocked(w, bytes);
    if (off < 0) {
      *kind = ErrorCode::kResourceExhausted;
      std::ostringstream os;
      os << "dfccl: collective '" << s.key << "' (seq " << t.seq << "): the shared staging arena of process "
         << w.me << " is full (" << w.staged_bytes << " of " << w.arena_bytes << " bytes held by collectives "
         << "in flight, " << bytes << " more needed); raise jax_dfccl.config.shm_arena_bytes before initialize()";
      *error = os.str();
      return false;
    }
  }
  if (bytes > 0) std::memcpy(w.arenas[w.me] + off, t.in, s.in_bytes());
  shm::Table::Post p;
  p.group_hash = HashString(s.GroupName());
  p.key_hash = s.key_hash;
  p.seq = t.seq;
  p.n = s.nranks;
  p.rank = s.rank;
  p.proc = w.me;
  p.devices = s.group_devices.data();
  p.key = s.key;
  p.sig = s.Signature();
  p.offset = off;
  p.start_ns = t.start_ns;
  p.run = t.run;
  shm::Table::PostResult r;
  try {
    // An entry of an execution this process has left behind (dfccl/execution.h): this start
    // belongs to the key's next sequence number, where the peers' later execution meets it.
    for (int hops = 0;; ++hops) {
      r = w.table->Arrive(p);
      if (!r.skip) break;
      RingGroup(w, w.table->entry(r.entry));  // its posted ranks fail
      DFCCL_CHECK(hops < kMaxSkips, "dfccl: collective '" << s.key << "': more than " << kMaxSkips
                                             << " failed executions of its peers in a row");
      std::lock_guard<std::mutex> l(t.comm->mu);
      auto& cnt = t.comm->counters[s.key_hash];
      p.seq = t.seq = t.inst->seq = cnt[s.rank]++;
    }
  } catch (...) {
    std::lock_guard<std::mutex> l(w.mu);
    if (bytes > 0) FreeBlockLocked(w, off, bytes);
    throw;
  }
  if (r.undo) {  // this execution was left behind: its sequence number stays for the next one
    std::lock_guard<std::mutex> l(t.comm->mu);
    auto& cnt = t.comm->counters[s.key_hash];
    if (cnt[s.rank] == t.seq + 1) cnt[s.rank] = t.seq;
  }
  if ((r.failed && !r.undo) || r.ready) RingGroup(w, w.table->entry(r.entry));
  std::lock_guard<std::mutex> l(w.mu);
  if (r.failed) {
    if (bytes > 0) FreeBlockLocked(w, off, bytes);  // never read
    *kind = static_cast<ErrorCode>(r.err_kind);
    *error = r.error;
    return false;
  }
  if (bytes > 0) w.staged.push_back(Staged{r.entry, r.gen, off, bytes});
  t.shm = std::make_shared<ShmRef>();
  t.shm->entry = r.entry;
  t.shm->gen = r.gen;
  t.shm->next_check_ns = t.start_ns + kLivenessPeriodNs;
  return true;
}

bool ShmReady(const Task& t) { return W().table->Ready(t.shm->entry); }
int ShmPosted(const Task& t) { return W().table->Posted(t.shm->entry); }

bool ShmPoll(Task& t) {
  World& w = W();
  const shm::Entry& en = w.table->entry(t.shm->entry);
  if (en.state.load(std::memory_order_acquire) == shm::kFailed) {
    CompleteFromTable(t);
    return true;
  }
  const int64_t now = NowNs();
  if (now < t.shm->next_check_ns) return false;
  t.shm->next_check_ns = now + kLivenessPeriodNs;
  bool dead = false;
  for (int r = 0; r < en.n && !dead; ++r)  // a hint without the lock; FailOpen re-checks under it
    dead = !__atomic_load_n(&en.slots[r].posted, __ATOMIC_RELAXED) && !ProcessGone(w, ProcOf(w, en.devices[r])).empty();
  if (!dead) return false;
  const bool failed = w.table->FailOpen(t.shm->entry, t.shm->gen, static_cast<int32_t>(ErrorCode::kAborted), true, [&](const shm::Entry& e) {
    std::ostringstream os;
    os << "dfccl: collective '" << e.key << "' (seq " << e.seq << ") failed on rank " << t.spec.rank
       << ": rank(s) [";
    bool first = true;
    for (int r = 0; r < e.n; ++r) {
      if (e.slots[r].posted) continue;
      const std::string gone = ProcessGone(w, ProcOf(w, e.devices[r]));
      if (gone.empty()) continue;
      os << (first ? "" : ", ") << RankName(w, e, r) << " " << gone;
      first = false;
    }
    os << "] before starting it";
    return first ? std::string() : os.str();  // nobody gone after all (posted meanwhile)
  });
  if (failed) RingGroup(w, en);
  if (en.state.load(std::memory_order_acquire) == shm::kFailed) {
    CompleteFromTable(t);
    return true;
  }
  return false;  // became ready meanwhile
}

void ShmComputeAndRelease(Task& t) {
  World& w = W();
  const shm::Entry& en = w.table->entry(t.shm->entry);
  TraceEvent(t.spec.self_device, t.spec.key, t.seq, "run");
  std::vector<const void*> ins(en.n);
  for (int r = 0; r < en.n; ++r) ins[r] = w.arenas[en.slots[r].proc] + en.slots[r].offset;
  const Status computed = ExecuteCollectiveStatus(t.spec, ins, [&t] { return t.ComputeTarget(); });
  const ErrorCode kind = computed.code;
  const std::string& msg = computed.message;
  w.table->ReleaseReader(t.shm->entry, t.shm->gen);
  t.Complete(kind, msg);
}

void ShmFailOnTimeout(Task& t, double timeout_s) {
  World& w = W();
  const bool failed = w.table->FailOpen(t.shm->entry, t.shm->gen, static_cast<int32_t>(ErrorCode::kDeadlineExceeded),
                                       false, [&](const shm::Entry& e) {
    std::ostringstream os;
    os << "dfccl: collective '" << e.key << "' (seq " << e.seq << ") timed out after " << timeout_s << " s on rank "
       << t.spec.rank << ": ranks [";
    bool first = true;
    for (int r = 0; r < e.n; ++r) {
      if (e.slots[r].posted) continue;
      os << (first ? "" : ", ") << RankName(w, e, r);
      first = false;
    }
    os << "] never started it";
    return os.str();
  });
  if (failed) RingGroup(w, w.table->entry(t.shm->entry));
  CompleteFromTable(t);
}

void ShmAbort(Task& t, const std::string& failed_key) {
  World& w = W();
  const bool failed = w.table->FailOpen(t.shm->entry, t.shm->gen, static_cast<int32_t>(ErrorCode::kAborted), false,
                                       [&](const shm::Entry& e) {
    std::ostringstream os;
    os << "dfccl: collective '" << e.key << "' (seq " << e.seq << ") failed: rank " << t.spec.rank << " (device "
       << t.spec.self_device << ", process " << w.me << ") stopped after an error in collective '" << failed_key
       << "'";
    return os.str();
  });
  if (failed) {
    RingGroup(w, w.table->entry(t.shm->entry));
    CompleteFromTable(t);
  }
}

std::string ShmPendingReport() {
  World& w = W();
  if (!w.attached.load(std::memory_order_acquire)) return "";
  const int64_t now = NowNs();
  std::vector<std::string> lines;
  for (const auto& ep : w.table->Snapshot()) {
    const shm::Entry& e = *ep;
    std::ostringstream os, in, out, group;
    int64_t first = now;
    for (int r = 0; r < e.n; ++r) {
      group << (r ? "," : "") << e.devices[r];
      std::ostringstream& o = e.slots[r].posted ? in : out;
      o << (o.tellp() > 0 ? ", " : "") << RankName(w, e, r);
      if (!e.slots[r].posted) {
        const std::string gone = ProcessGone(w, ProcOf(w, e.devices[r]));
        if (!gone.empty()) o << " " << gone;
      } else {
        first = std::min(first, e.slots[r].start_ns);
      }
    }
    os << "group " << group.str() << ": '" << e.key << "' seq " << e.seq << ", started by rank(s) [" << in.str()
       << "]";
    if (out.tellp() > 0) os << ", not by [" << out.str() << "]";
    os << ", first start " << (now - first) / 1000000 << " ms ago";
    if (e.state.load() == shm::kFailed) os << ", failed: " << e.error;
    lines.push_back(os.str());
  }
  std::sort(lines.begin(), lines.end());
  std::string report;
  for (const std::string& l : lines) report += l + "\n";
  return report;
}

void ShmReset() {
  World& w = W();
  if (!w.attached.load(std::memory_order_acquire)) return;
  if (w.table->ResetProcess(w.me, "dfccl: collective aborted by reset() of process " + std::to_string(w.me)) > 0)
    for (int32_t p = 0; p < w.table->nprocs(); ++p) w.table->Ring(p);
  std::lock_guard<std::mutex> l(w.mu);
  ReclaimLocked(w);
}

ShmStats GetShmStats() {
  World& w = W();
  ShmStats s;
  if (!w.attached.load(std::memory_order_acquire)) return s;
  s.attached = true;
  s.process = w.me;
  s.processes = w.table->nprocs();
  s.live_entries = w.table->live();
  std::lock_guard<std::mutex> l(w.mu);
  ReclaimLocked(w);
  s.staged_bytes = w.staged_bytes;
  s.arena_bytes = w.arena_bytes;
  return s;
}

// ---- bootstrap ----------------------------------------------------------------------
size_t ShmControlBytes(int entries) { return shm::Table::Bytes(entries); }

void ShmCreate(const std::string& name, int64_t bytes, bool control, int nprocs, int entries) {
  World& w = W();
  std::lock_guard<std::mutex> l(w.mu);
  DFCCL_CHECK(!w.attached.load(), "dfccl: initialize(): the runtime already spans processes");
  const size_t size = control ? shm::Table::Bytes(entries) : static_cast<size_t>(bytes);
  void* p = shm::CreateSegment(name, size);
  if (control) shm::Table::Format(p, nprocs, entries);
  w.own[name] = {p, size};
  if (!control) {
    w.arena_bytes = static_cast<int64_t>(size);
    w.free_blocks.clear();
    w.free_blocks.emplace(0, w.arena_bytes);
  }
}

void ShmAttach(const std::string& control, const std::vector<std::string>& arenas, int process,
               const std::vector<std::pair<int64_t, int32_t>>& device_procs) {
  World& w = W();
  std::lock_guard<std::mutex> l(w.mu);
  DFCCL_CHECK(!w.attached.load(), "dfccl: initialize(): the runtime already spans processes");
  auto map = [&](const std::string& name) -> char* {
    if (auto it = w.own.find(name); it != w.own.end()) return static_cast<char*>(it->second.first);
    size_t bytes = 0;
    return static_cast<char*>(shm::OpenSegment(name, &bytes));
  };
  w.table = new shm::Table(map(control));  // leaked with the world
  DFCCL_CHECK(static_cast<int>(arenas.size()) == w.table->nprocs() && process >= 0 && process < w.table->nprocs(),
              "dfccl: initialize(): " << arenas.size() << " arenas for " << w.table->nprocs() << " processes");
  for (const std::string& a : arenas) w.arenas.push_back(map(a));
  w.me = process;
  for (auto [d, p] : device_procs) w.device_proc[d] = p;
  shm::Proc& me = w.table->proc(process);
  me.pid.store(static_cast<int32_t>(getpid()), std::memory_order_relaxed);
  me.state.store(shm::kProcAlive, std::memory_order_release);
  w.attached.store(true, std::memory_order_release);
  std::thread([wp = &w] {
    NameThisThread("dfccl-bell");
    BellLoop(wp);
  }).detach();
}

void ShmDetach() {
  World& w = W();
  if (!w.attached.load(std::memory_order_acquire)) return;
  w.table->proc(w.me).state.store(shm::kProcExited, std::memory_order_release);
  for (int32_t p = 0; p < w.table->nprocs(); ++p) w.table->Ring(p);
}

}  // namespace dfccl::cpu
