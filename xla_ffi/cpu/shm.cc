// The shared-memory matching protocol (see shm.h for the invariants).
#include "cpu/shm.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <thread>

#include "dfccl/check.h"
#include "dfccl/execution.h"

namespace dfccl::shm {

// ---- lock ------------------------------------------------------------------------
void Acquire(Lock& l) {
  static const int32_t me = static_cast<int32_t>(getpid());
  auto t_check = std::chrono::steady_clock::now();
  for (int spins = 0;; ++spins) {
    int32_t expected = 0;
    if (l.owner.compare_exchange_weak(expected, me, std::memory_order_acquire, std::memory_order_relaxed)) return;
    if (spins < 64) continue;
    std::this_thread::yield();
    // The holder was killed inside its (short) critical section: take over.
    const auto now = std::chrono::steady_clock::now();
    if (now - t_check > std::chrono::milliseconds(2)) {
      t_check = now;
      if (expected != 0 && expected != me && !ProcessAlive(expected) &&
          l.owner.compare_exchange_strong(expected, me, std::memory_order_acquire, std::memory_order_relaxed))
        return;
    }
  }
}

void Release(Lock& l) { l.owner.store(0, std::memory_order_release); }

namespace {
struct Guard {
  explicit Guard(Lock& l) : l_(l) { Acquire(l_); }
  ~Guard() { Release(l_); }
  Lock& l_;
};

uint64_t Mix(uint64_t g, uint64_t k, int64_t s) {
  uint64_t h = g * 0x9e3779b97f4a7c15ull ^ (k + 0x632be59bd9b4e019ull) ^ (static_cast<uint64_t>(s) << 17);
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 32);
}

void CopyStr(char* dst, size_t cap, const std::string& s) {
  const size_t m = std::min(s.size(), cap - 1);
  std::memcpy(dst, s.data(), m);
  dst[m] = 0;
}

size_t Align(size_t x) { return (x + 63) & ~size_t{63}; }
}  // namespace

// ---- table -------------------------------------------------------------------------
size_t Table::Bytes(int entries) {
  return Align(sizeof(Header)) + Align(sizeof(IndexCell) * 2 * entries) + sizeof(Entry) * entries;
}

void Table::Format(void* base, int nprocs, int entries) {
  DFCCL_CHECK(nprocs >= 1 && nprocs <= kMaxProcs, "dfccl: at most " << kMaxProcs << " processes");
  std::memset(base, 0, Bytes(entries));  // a fresh segment is zero already; be explicit
  auto* h = static_cast<Header*>(base);
  h->nprocs = nprocs;
  h->entries = entries;
  h->cells = 2 * entries;
  h->magic = kMagic;  // peers map the segment only after a barrier (distributed.py)
}

Table::Table(void* base) : header_(static_cast<Header*>(base)) {
  DFCCL_CHECK(header_->magic == kMagic, "dfccl: the shared control segment is not formatted");
  cells_ = reinterpret_cast<IndexCell*>(static_cast<char*>(base) + Align(sizeof(Header)));
  entries_ = reinterpret_cast<Entry*>(reinterpret_cast<char*>(cells_) + Align(sizeof(IndexCell) * header_->cells));
}

int32_t Table::FindLocked(uint64_t g, uint64_t k, int64_t seq) const {
  const int32_t m = header_->cells;
  for (int32_t i = 0, c = static_cast<int32_t>(Mix(g, k, seq) % m); i < m; ++i, c = (c + 1) % m) {
    const IndexCell& cell = cells_[c];
    if (cell.state == 0) return -1;
    if (cell.state == 1 && cell.group_hash == g && cell.key_hash == k && cell.seq == seq) return cell.entry;
  }
  return -1;
}

void Table::RebuildLocked() {
  const int32_t m = header_->cells;
  std::memset(cells_, 0, sizeof(IndexCell) * m);
  header_->tombstones = 0;
  for (int32_t e = 0; e < header_->entries; ++e) {
    const Entry& en = entries_[e];
    if (en.state.load(std::memory_order_relaxed) == kFree) continue;
    int32_t c = static_cast<int32_t>(Mix(en.group_hash, en.key_hash, en.seq) % m);
    while (cells_[c].state == 1) c = (c + 1) % m;
    cells_[c] = IndexCell{en.group_hash, en.key_hash, en.seq, e, 1};
  }
}

int32_t Table::InsertLocked(uint64_t g, uint64_t k, int64_t seq) {
  DFCCL_CHECK(header_->live < header_->entries,
              "dfccl: more than " << header_->entries << " collective instances in flight across processes");
  if (header_->tombstones > header_->cells / 4) RebuildLocked();
  int32_t e = header_->cursor;
  while (entries_[e].state.load(std::memory_order_relaxed) != kFree) e = (e + 1) % header_->entries;
  header_->cursor = (e + 1) % header_->entries;
  const int32_t m = header_->cells;
  int32_t c = static_cast<int32_t>(Mix(g, k, seq) % m);
  while (cells_[c].state == 1) c = (c + 1) % m;
  if (cells_[c].state == 2) --header_->tombstones;
  cells_[c] = IndexCell{g, k, seq, e, 1};
  ++header_->live;
  return e;
}

void Table::FreeLocked(int32_t e) {
  Entry& en = entries_[e];
  const int32_t m = header_->cells;
  for (int32_t i = 0, c = static_cast<int32_t>(Mix(en.group_hash, en.key_hash, en.seq) % m); i < m;
       ++i, c = (c + 1) % m) {
    IndexCell& cell = cells_[c];
    if (cell.state == 0) break;
    if (cell.state == 1 && cell.entry == e) {
      cell.state = 2;
      ++header_->tombstones;
      break;
    }
  }
  --header_->live;
  en.state.store(kFree, std::memory_order_relaxed);
  en.gen.fetch_add(1, std::memory_order_release);
}

Table::PostResult Table::Arrive(const Post& p) {
  DFCCL_CHECK(p.n >= 1 && p.n <= kMaxRanks, "dfccl: collective '" << p.key << "': groups spanning processes "
                                                                      "have at most " << kMaxRanks << " ranks");
  PostResult r;
  Guard g(header_->lock);
  int32_t e = FindLocked(p.group_hash, p.key_hash, p.seq);
  if (e < 0) {
    e = InsertLocked(p.group_hash, p.key_hash, p.seq);
    Entry& en = entries_[e];
    en.group_hash = p.group_hash;
    en.key_hash = p.key_hash;
    en.seq = p.seq;
    en.n = p.n;
    en.arrived = en.acked = en.err_kind = en.dead_cause = en.has_stale_run = 0;
    en.stale_run = 0;
    en.posted.store(0, std::memory_order_relaxed);
    en.readers_done.store(0, std::memory_order_relaxed);
    for (int i = 0; i < p.n; ++i) {
      en.devices[i] = p.devices[i];
      en.slots[i].posted = 0;
    }
    CopyStr(en.key, kKeyLen, p.key);
    en.error[0] = 0;
    en.state.store(kOpen, std::memory_order_relaxed);
  }
  Entry& en = entries_[e];
  r.entry = e;
  r.gen = en.gen.load(std::memory_order_relaxed);
  ++en.arrived;
  auto maybe_free = [&] {
    if (en.arrived >= en.n && en.acked >= en.posted.load(std::memory_order_relaxed)) FreeLocked(e);
  };
  if (en.state.load(std::memory_order_relaxed) == kFailed) {
    if (en.has_stale_run && CompareRuns(p.run, en.stale_run) == RunOrder::kLater) {
      r.skip = true;  // failed for an execution this rank's process has left behind: not this rank's instance
      maybe_free();
      return r;
    }
    r.failed = true;
    r.err_kind = en.err_kind;
    r.error = en.error;
    maybe_free();
    return r;
  }
  // The execution identity (dfccl/execution.h): a posted rank of another execution of the same program.
  for (int q = 0; q < en.n; ++q) {
    if (!en.slots[q].posted) continue;
    const RunOrder order = CompareRuns(p.run, en.slots[q].run);
    if (order != RunOrder::kLater && order != RunOrder::kEarlier) continue;
    const bool later = order == RunOrder::kLater;
    auto ranks_of_q = [&] {  // the posted ranks of q's execution, as the message names them
      std::ostringstream rs;
      bool first = true;
      for (int i = 0; i < en.n; ++i)
        if (en.slots[i].posted && en.slots[i].run == en.slots[q].run) {
          rs << (first ? "" : ", ") << i << " (device " << en.devices[i] << ", process " << en.slots[i].proc << ")";
          first = false;
        }
      return rs.str();
    };
    std::ostringstream os;
    os << "dfccl: collective '" << p.key << "' (seq " << p.seq << ") aborted: a peer's program failed. ";
    if (later) {  // the posted ranks' execution was left behind by this rank's process
      os << "Rank " << p.rank << " (device " << p.devices[p.rank] << ", process " << p.proc
         << ") started it in a later execution of the same program (launch id " << p.run << ") than rank(s) ["
         << ranks_of_q() << "] (launch id " << en.slots[q].run << "): its program failed in that execution before it started "
         << "this collective, so the execution fails on every process";
      CopyStr(en.error, kErrLen, os.str());
      en.err_kind = static_cast<int32_t>(ErrorCode::kAborted);
      en.has_stale_run = 1;
      en.stale_run = en.slots[q].run;
      en.state.store(kFailed, std::memory_order_release);
      r.skip = true;
      maybe_free();
      return r;
    }
    // This rank's execution was left behind by the posted rank's process: fail without arriving.
    os << "Rank(s) [" << ranks_of_q() << "] started it in a later execution of the same program (launch id " << en.slots[q].run << ") than rank "
       << p.rank << " (device " << p.devices[p.rank] << ", process " << p.proc << ") (launch id " << p.run
       << "): the program failed in this execution on that process before it started this collective, so the "
          "execution fails on every process";
    --en.arrived;
    r.failed = r.undo = true;
    r.err_kind = static_cast<int32_t>(ErrorCode::kAborted);
    r.error = os.str();
    return r;
  }
  std::string sig = p.sig.substr(0, kSigLen - 1);
  for (int q = 0; q < en.n; ++q) {
    if (!en.slots[q].posted || sig == en.slots[q].sig) continue;
    const int lo = std::min(q, p.rank), hi = std::max(q, p.rank);
    const std::string lo_sig = lo == p.rank ? sig : std::string(en.slots[lo].sig);
    const std::string hi_sig = hi == p.rank ? sig : std::string(en.slots[hi].sig);
    std::ostringstream os;
    os << "dfccl: collective '" << p.key << "' (seq " << p.seq << ") mismatch: rank " << lo << " " << lo_sig
       << " vs rank " << hi << " " << hi_sig;
    CopyStr(en.error, kErrLen, os.str());
    en.err_kind = static_cast<int32_t>(ErrorCode::kFailedPrecondition);
    en.state.store(kFailed, std::memory_order_release);
    r.failed = true;
    r.err_kind = en.err_kind;
    r.error = en.error;
    maybe_free();
    return r;
  }
  DFCCL_CHECK(!en.slots[p.rank].posted, "dfccl: collective '" << p.key << "' (seq " << p.seq << "): rank "
                                                              << p.rank << " started twice");
  Slot& s = en.slots[p.rank];
  s.proc = p.proc;
  s.offset = p.offset;
  s.start_ns = p.start_ns;
  s.run = p.run;
  CopyStr(s.sig, kSigLen, sig);
  s.posted = 1;
  const int32_t now = en.posted.load(std::memory_order_relaxed) + 1;
  en.posted.store(now, std::memory_order_release);  // publishes the slot
  r.ready = now == en.n;
  return r;
}

bool Table::TakeFailure(int32_t e, uint32_t gen, int32_t* kind, std::string* error) {
  Entry& en = entries_[e];
  if (en.state.load(std::memory_order_acquire) != kFailed) return false;
  Guard g(header_->lock);
  if (en.gen.load(std::memory_order_relaxed) != gen || en.state.load(std::memory_order_relaxed) != kFailed)
    return false;  // cannot happen for a posted rank that has not acknowledged
  *kind = en.err_kind;
  *error = en.error;
  ++en.acked;
  if (!en.dead_cause && en.arrived >= en.n && en.acked >= en.posted.load(std::memory_order_relaxed)) FreeLocked(e);
  return true;
}

void Table::ReleaseReader(int32_t e, uint32_t gen) {
  Entry& en = entries_[e];
  if (en.readers_done.fetch_add(1, std::memory_order_acq_rel) + 1 < en.n) return;
  Guard g(header_->lock);
  if (en.gen.load(std::memory_order_relaxed) == gen) FreeLocked(e);
}

bool Table::Reclaimable(int32_t e, uint32_t gen) const {
  const Entry& en = entries_[e];
  return en.gen.load(std::memory_order_acquire) != gen || en.state.load(std::memory_order_acquire) == kFailed;
}

void Table::Ring(int32_t p) {
  std::atomic<uint32_t>& bell = header_->procs[p].bell;
  bell.fetch_add(1, std::memory_order_release);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void Table::WaitBell(int32_t p, uint32_t seen, int64_t timeout_us) {
  struct timespec ts{static_cast<time_t>(timeout_us / 1000000), static_cast<long>(timeout_us % 1000000) * 1000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&header_->procs[p].bell), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

std::vector<std::unique_ptr<Entry>> Table::Snapshot() {
  std::vector<std::unique_ptr<Entry>> out;
  Guard g(header_->lock);
  for (int32_t e = 0; e < header_->entries; ++e) {
    const Entry& en = entries_[e];
    if (en.state.load(std::memory_order_relaxed) == kFree) continue;
    out.push_back(std::make_unique<Entry>());
    std::memcpy(static_cast<void*>(out.back().get()), &en, sizeof(Entry));
  }
  return out;
}

int Table::ResetProcess(int32_t proc, const std::string& msg) {
  int touched = 0;
  Guard g(header_->lock);
  for (int32_t e = 0; e < header_->entries; ++e) {
    Entry& en = entries_[e];
    const uint32_t st = en.state.load(std::memory_order_relaxed);
    if (st == kFailed) {
      FreeLocked(e);
      ++touched;
      continue;
    }
    if (st != kOpen || en.posted.load(std::memory_order_relaxed) == en.n) continue;
    bool mine = false;
    for (int r = 0; r < en.n; ++r) mine |= en.slots[r].posted && en.slots[r].proc == proc;
    if (!mine) continue;
    CopyStr(en.error, kErrLen, msg);
    en.err_kind = static_cast<int32_t>(ErrorCode::kAborted);
    en.state.store(kFailed, std::memory_order_release);
    ++touched;
  }
  return touched;
}

int32_t Table::live() {
  Guard g(header_->lock);
  return header_->live;
}

// ---- segments ------------------------------------------------------------------------
void* CreateSegment(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  DFCCL_CHECK(fd >= 0, "dfccl: shm_open(" << name << ") failed: " << std::strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    DFCCL_FAIL("dfccl: ftruncate(" << name << ", " << bytes << ") failed: " << std::strerror(err));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    DFCCL_FAIL("dfccl: mmap(" << name << ") failed: " << std::strerror(errno));
  }
  return p;
}

void* OpenSegment(const std::string& name, size_t* bytes) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  DFCCL_CHECK(fd >= 0, "dfccl: shm_open(" << name << ") failed: " << std::strerror(errno));
  struct stat st{};
  fstat(fd, &st);
  *bytes = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, *bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  DFCCL_CHECK(p != MAP_FAILED, "dfccl: mmap(" << name << ") failed: " << std::strerror(errno));
  return p;
}

void UnlinkSegment(const std::string& name) { shm_unlink(name.c_str()); }

int SweepDeadSegments() {
  int removed = 0;
  DIR* d = opendir("/dev/shm");
  if (!d) return 0;
  while (dirent* ent = readdir(d)) {
    int pid = 0;
    if (std::sscanf(ent->d_name, "dfccl.%d.", &pid) != 1 || ProcessAlive(pid)) continue;
    if (shm_unlink((std::string("/") + ent->d_name).c_str()) == 0) ++removed;
  }
  closedir(d);
  return removed;
}

}  // namespace dfccl::shm
