// The direct path across processes: exported ranges and their mappings (runtime/ipc.h).
#include "runtime/ipc.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <sstream>

#include "dfccl/check.h"
#include "dfccl/host.h"

namespace dfccl::gpu {
namespace {

constexpr uint32_t kMagic = 0x64666378;  // "dfcx"
constexpr int kMap = 1, kRetire = 2;
constexpr size_t kNameBytes = 96;

sockaddr_un Address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  DFCCL_CHECK(name.size() + 1 < sizeof(a.sun_path), "dfccl: socket name too long: " << name);
  a.sun_path[0] = '\0';  // abstract: nothing in the file system
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

std::string Hex(uint64_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

}  // namespace

struct Ipc::Msg {
  uint32_t magic, type;
  int32_t tag, pad;
  uint64_t base, size;
  char from[kNameBytes];
};

Ipc::~Ipc() {
  if (wake_[1] >= 0) {
    const char c = 1;
    (void)!write(wake_[1], &c, 1);
  }
  if (thread_.joinable()) thread_.join();
  for (auto& [peer, fd] : peers_)
    if (fd >= 0) close(fd);
  for (auto& [base, e] : exports_)
    if (e.fd >= 0) close(e.fd);
  for (auto& [name, t] : tables_) {
    for (auto& [tag, m] : t.maps) Vmm::Unmap(m);
    for (auto& [ord, c] : t.cache) cudaFree(c);
    if (t.shared) cudaFreeHost(t.shared);
  }
  for (int fd : {listen_fd_, wake_[0], wake_[1]})
    if (fd >= 0) close(fd);
}

void Ipc::Start(const std::string& name, const std::vector<int>& ordinals) {
  std::lock_guard lk(mu_);
  DFCCL_CHECK(listen_fd_ < 0, "dfccl: the IPC listener is already running as " << name_);
  DFCCL_CHECK(!ordinals.empty(), "dfccl: no local GPU for the IPC listener");
  DFCCL_CHECK(name.size() + 1 < kNameBytes, "dfccl: socket name too long: " << name);
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  DFCCL_CHECK(fd >= 0, "dfccl: socket(AF_UNIX): " << std::strerror(errno));
  socklen_t len = 0;
  const sockaddr_un a = Address(name, &len);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&a), len) != 0 || listen(fd, 64) != 0) {
    const int e = errno;
    close(fd);
    DFCCL_CHECK(false, "dfccl: listening at @" << name << ": " << std::strerror(e));
  }
  DFCCL_CHECK(pipe2(wake_, O_CLOEXEC) == 0, "dfccl: pipe: " << std::strerror(errno));
  listen_fd_ = fd;
  name_ = name;
  ordinals_ = ordinals;
  thread_ = std::thread([this] { Serve(); });
}

std::string Ipc::CanExport(const void* p) {
  try {
    const Vmm::Range r = Vmm::RangeOf(p);
    const int fd = Vmm::ExportFd(r.base);
    close(fd);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

int Ipc::Connect(const std::string& peer) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  DFCCL_CHECK(fd >= 0, "dfccl: socket(AF_UNIX): " << std::strerror(errno));
  socklen_t len = 0;
  const sockaddr_un a = Address(peer, &len);
  // The peer listens from its jax_dfccl.initialize(), which came before it shared
  // any group; a few seconds cover a peer still on its way there.
  for (int i = 0; i < 500; ++i) {
    if (connect(fd, reinterpret_cast<const sockaddr*>(&a), len) == 0) return fd;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int e = errno;
  close(fd);
  DFCCL_CHECK(false, "dfccl: cannot reach process @" << peer << " (" << std::strerror(e) << ")");
  return -1;
}

// mu_ held.  A peer that is gone is not written to again (the others' watchdog names it).
void Ipc::SendTo(const std::string& peer, int type, int tag, uint64_t base, uint64_t size, int fd) {
  auto it = peers_.find(peer);
  if (it == peers_.end() || it->second < 0) return;
  Msg m{};
  m.magic = kMagic;
  m.type = static_cast<uint32_t>(type);
  m.tag = tag;
  m.base = base;
  m.size = size;
  std::memcpy(m.from, name_.data(), name_.size());
  iovec io{&m, sizeof(m)};
  msghdr h{};
  h.msg_iov = &io;
  h.msg_iovlen = 1;
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    h.msg_control = ctl;
    h.msg_controllen = sizeof(ctl);
    cmsghdr* c = CMSG_FIRSTHDR(&h);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  if (sendmsg(it->second, &h, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(m))) {
    errors_.push_back("dfccl: process @" + peer + " is unreachable (" + std::strerror(errno) +
                      "): its collectives with this process will time out");
    close(it->second);
    it->second = -1;
  }
}

int Ipc::Tag(const void* p, int ordinal) {
  if (p == nullptr) return 0;
  std::lock_guard lk(mu_);
  DeviceGuard guard(ordinal);
  const Vmm::Range r = Vmm::RangeOf(p);
  auto it = exports_.find(r.base);
  if (it != exports_.end() && it->second.size == r.size && it->second.id == r.id) return it->second.tag;
  DFCCL_CHECK_CODE(next_tag_ < kMaxXRanges, ErrorCode::kResourceExhausted,
                   "dfccl: more than " << kMaxXRanges - 1 << " allocations shared with other processes (the "
                   "direct path across processes needs an allocator that keeps its allocations, XLA's default; "
                   "or set jax_dfccl.config.tuning.direct = False)");
  const int fd = Vmm::ExportFd(r.base);  // first: a range that cannot be exported changes nothing
  // A range that overlaps known ones replaces them: the allocator gave them back.
  for (auto o = exports_.begin(); o != exports_.end();) {
    if (o->first < r.base + r.size && r.base < o->first + o->second.size) {
      for (auto& [peer, sock] : peers_) SendTo(peer, kRetire, o->second.tag, o->first, o->second.size, -1);
      close(o->second.fd);
      o = exports_.erase(o);
    } else {
      ++o;
    }
  }
  Export e;
  e.size = r.size;
  e.id = r.id;
  e.tag = next_tag_++;
  e.fd = fd;
  exports_[r.base] = e;
  exported_++;
  for (auto& [peer, sock] : peers_) SendTo(peer, kMap, e.tag, r.base, r.size, e.fd);
  return e.tag;
}

// tables_mu_ held.
Ipc::Table& Ipc::TableOf(const std::string& peer) {
  auto it = tables_.find(peer);
  if (it != tables_.end()) return it->second;
  Table t;
  t.entries.assign(kMaxXRanges, XRange{});
  return tables_.emplace(peer, std::move(t)).first->second;
}

// tables_mu_ held.  Into the shared table, by plain stores: an entry is written
// once (tags are never reused) and its local_base last; a retired entry only
// loses its local_base.  A lane reads an entry's two 16-byte halves at once and
// takes it only when local_base, gen and size are all there (device/direct.cuh
// XLocal), so no store order across PCIe is needed.
void Ipc::Publish(Table& t, int tag) {
  if (t.shared == nullptr) return;  // no local GPU reads it yet (AddPeer copies the entries)
  const XRange& e = t.entries[tag];
  XRange& s = t.shared[tag];
  if (e.local_base == 0) {
    std::atomic_ref<uint64_t>(s.local_base).store(0, std::memory_order_release);
    return;
  }
  std::atomic_ref<uint64_t>(s.remote_base).store(e.remote_base, std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(s.size).store(e.size, std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(s.gen).store(e.gen, std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(s.local_base).store(e.local_base, std::memory_order_release);
}

const XRange* Ipc::AddPeer(const std::string& peer, int ordinal) {
  DFCCL_CHECK(started(), "dfccl: the IPC listener is not running (jax_dfccl.initialize)");
  std::lock_guard lk(mu_);
  XRange* table = nullptr;
  {
    std::lock_guard tl(tables_mu_);
    Table& t = TableOf(peer);
    DeviceGuard guard(ordinal);
    if (t.shared == nullptr) {
      void* p = nullptr;
      DFCCL_CHECK_CUDA(cudaHostAlloc(&p, sizeof(XRange) * kMaxXRanges, cudaHostAllocMapped | cudaHostAllocPortable),
                       "dfccl: range table");
      std::memcpy(p, t.entries.data(), sizeof(XRange) * kMaxXRanges);
      t.shared = static_cast<XRange*>(p);
    }
    XRange*& cache = t.cache[ordinal];
    if (cache == nullptr) {  // (set-up: the only copy into it the host ever makes)
      void* shared = nullptr;
      DFCCL_CHECK_CUDA(cudaHostGetDevicePointer(&shared, t.shared, 0), "dfccl: range table");
      void* p = nullptr;
      DFCCL_CHECK_CUDA(cudaMalloc(&p, sizeof(XRange) * kMaxXRanges), "dfccl: range table cache");
      std::vector<XRange> init(kMaxXRanges, XRange{});
      init[0].remote_base = reinterpret_cast<uint64_t>(shared);  // entry 0 (no tag) says where the table is
      cudaStream_t st = nullptr;
      DFCCL_CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "dfccl: range table cache");
      cudaError_t r = cudaMemcpyAsync(p, init.data(), sizeof(XRange) * kMaxXRanges, cudaMemcpyHostToDevice, st);
      if (r == cudaSuccess) r = cudaStreamSynchronize(st);
      cudaStreamDestroy(st);
      if (r != cudaSuccess) cudaFree(p);
      DFCCL_CHECK_CUDA(r, "dfccl: range table cache");
      cache = static_cast<XRange*>(p);
    }
    table = cache;
  }
  if (peers_.find(peer) == peers_.end()) {
    peers_[peer] = Connect(peer);
    for (auto& [base, e] : exports_) SendTo(peer, kMap, e.tag, base, e.size, e.fd);
  }
  return table;
}

std::vector<std::string> Ipc::errors() {
  std::vector<std::string> v;
  {
    std::lock_guard lk(mu_);
    v = errors_;
  }
  std::lock_guard el(import_errors_mu_);
  v.insert(v.end(), import_errors_.begin(), import_errors_.end());
  return v;
}

// tables_mu_ held.
void Ipc::OnMessage(const Msg& m, int fd) {
  const std::string from(m.from, strnlen(m.from, kNameBytes));
  if (m.magic != kMagic || m.tag <= 0 || m.tag >= kMaxXRanges || (m.type == kMap && fd < 0)) {
    ImportError("dfccl: a malformed range message from @" + from);
    return;
  }
  Table& t = TableOf(from);
  XRange& x = t.entries[m.tag];
  try {
    auto old = t.maps.find(m.tag);
    if (old != t.maps.end()) {  // retired (or replaced): unpublish, then unmap
      x = XRange{};
      Serving("unpublishing a retired range (a range table copy)");
      Publish(t, m.tag);
      Serving("unmapping a retired range (cuMemUnmap)");
      Vmm::Unmap(old->second);
      t.maps.erase(old);
    }
    if (m.type == kMap) {
      DeviceGuard guard(ordinals_[0]);
      Serving("mapping a range (cuMemImportFromShareableHandle, cuMemMap, cuMemSetAccess)");
      const Vmm::Mapping map = Vmm::Import(fd, m.size, ordinals_);
      t.maps[m.tag] = map;
      x = XRange{m.base, m.size, map.va, gen_.fetch_add(1) + 1};  // (a daemon launched from now on may read it)
      Serving("publishing a range (a range table copy)");
      Publish(t, m.tag);
      mapped_++;
    }
  } catch (const std::exception& e) {
    ImportError("dfccl: mapping range " + Hex(m.base) + " (" + std::to_string(m.size) +
                             " bytes) of process @" + from + ": " + e.what() +
                             "; its collectives with this process will time out");
  }
}

void Ipc::ImportError(const std::string& e) {
  std::lock_guard el(import_errors_mu_);
  import_errors_.push_back(e);
}

namespace {
int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

void Ipc::Serving(const char* what) {
  serving_in_ = what;
  serving_since_ns_ = SteadyNs();
}

std::string Ipc::Describe() const {
  const int64_t now = SteadyNs(), since = serving_since_ns_.load();
  std::ostringstream os;
  os << exported_ << " ranges exported, " << mapped_ << " mapped; serving thread " << serving_in_.load();
  if (since > 0) os << " for " << (now - since) / 1000000 << " ms";
  return os.str();
}

void Ipc::Serve() {
  NameThisThread("dfccl-ipc");
  std::vector<int> conns;
  while (true) {
    std::vector<pollfd> fds{{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (int c : conns) fds.push_back({c, POLLIN, 0});
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents) break;
    std::vector<int> keep;
    if (fds[1].revents & POLLIN) {  // a new peer: polled from the next round on
      const int c = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c >= 0) keep.push_back(c);
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      const int c = fds[i].fd;
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) { keep.push_back(c); continue; }
      Msg m{};
      iovec io{&m, sizeof(m)};
      msghdr h{};
      h.msg_iov = &io;
      h.msg_iovlen = 1;
      alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
      h.msg_control = ctl;
      h.msg_controllen = sizeof(ctl);
      const ssize_t got = recvmsg(c, &h, MSG_CMSG_CLOEXEC);
      if (got <= 0) { close(c); continue; }  // the peer closed (or died)
      int fd = -1;
      for (cmsghdr* cm = CMSG_FIRSTHDR(&h); cm; cm = CMSG_NXTHDR(&h, cm))
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) std::memcpy(&fd, CMSG_DATA(cm), sizeof(int));
      {
        std::lock_guard tl(tables_mu_);
        if (got == static_cast<ssize_t>(sizeof(m))) OnMessage(m, fd);
        else ImportError("dfccl: a truncated range message");
      }
      Serving("waiting for ranges");
      if (fd >= 0) close(fd);
      keep.push_back(c);
    }
    conns = keep;
  }
  for (int c : conns) close(c);
}

}  // namespace dfccl::gpu
