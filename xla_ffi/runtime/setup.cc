// Device and communicator setup: host-mapped queues, device state, peer
// access, staging pools, the match table; the copy-engine path's host matching.
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <sstream>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "dfccl/host.h"
#include "dfccl/dtype.h"
#include "runtime/driver.h"
#include "runtime/runtime.h"

#define DFCCL_CUDA(call) DFCCL_CHECK_CUDA(call, "dfccl")

namespace dfccl::gpu {
Device& Runtime::GetDevice(int ordinal) {
  auto it = devices_.find(ordinal);
  if (it != devices_.end()) return *it->second;
  DeviceGuard guard(ordinal);
  auto d = std::make_unique<Device>();
  d->ordinal = ordinal;
  DFCCL_CUDA(cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking));
  DFCCL_CUDA(cudaStreamCreateWithFlags(&d->aux, cudaStreamNonBlocking));
  DFCCL_CUDA(cudaEventCreateWithFlags(&d->ev, cudaEventDisableTiming));
  DFCCL_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&d->host), sizeof(HostShared),
                           cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(static_cast<void*>(d->host), 0, sizeof(HostShared));
  DFCCL_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d->host_dev), d->host, 0));
  DFCCL_CUDA(cudaMalloc(reinterpret_cast<void**>(&d->dev), sizeof(DeviceShared)));
  DFCCL_CUDA(cudaMemsetAsync(d->dev, 0, sizeof(DeviceShared), d->aux));
  DFCCL_CUDA(cudaStreamSynchronize(d->aux));
  DFCCL_CUDA(PreloadStreamWait());
  DFCCL_CUDA(PreloadSubmitKernels());
  DFCCL_CUDA(PreloadReduceKernels());
  // The daemon needs local memory per thread (its stack: 528 bytes, ptxas).
  // A launch that needs more local memory than the context holds makes the driver
  // grow it, and growing waits inside cuLaunchKernel for the device's running
  // kernels: a larger daemon (Launch on a large message) launched while XLA's
  // stream spins in one of our done waits would wait for that wait, under the
  // runtime lock - a hang.  So the largest grid is launched once here, while none
  // of ours runs, and exits at once (its quit request is set before the launch);
  // the driver keeps the grown size.
  d->launch_id = 1;
  d->host->resize = d->launch_id;
  DaemonParams warm{};
  warm.dev = d->dev;
  warm.host = d->host_dev;
  warm.launch_id = d->launch_id;
  warm.workers = kMaxBlocks - 1;
  DFCCL_CUDA(LaunchDaemon(warm, d->stream));
  DFCCL_CUDA(cudaStreamSynchronize(d->stream));
  d->blocks_launched = warm.workers + 1;
  d->host->resize = 0;
  ce_.Prepare(ordinal);
  auto& ref = *d;
  DFCCL_CHECK(ordinal >= 0 && ordinal < static_cast<int>(by_ordinal_.size()), "dfccl: GPU ordinal " << ordinal);
  by_ordinal_[ordinal].store(d.get(), std::memory_order_release);
  devices_[ordinal] = std::move(d);
  if (!proxy_.joinable()) proxy_ = std::thread([this] {
    NameThisThread("dfccl-proxy");
    ProxyLoop();
  });
  return ref;
}

Device& Runtime::GetDeviceFast(int ordinal) {
  Device* d = ordinal >= 0 && ordinal < static_cast<int>(by_ordinal_.size())
                  ? by_ordinal_[ordinal].load(std::memory_order_acquire) : nullptr;
  DFCCL_CHECK_CODE(d != nullptr, ErrorCode::kFailedPrecondition, "dfccl: a done on GPU " << ordinal << " before any start");
  return *d;
}

std::string GroupText(const std::vector<int64_t>& group);

void Runtime::InitTable(Comm& c) {
  auto t = std::make_unique<MatchTable>();
  std::memset(static_cast<void*>(t.get()), 0, sizeof(MatchTable));
  for (int p = 0; p < kNumPools; ++p)
    for (int i = 0; i < c.view.pool[p].nslots; ++i) t->free_bits[p][i / 64] |= 1ull << (i % 64);
  DFCCL_CHECK(c.ordinals[0] >= 0, "dfccl: the match table is another process's");
  Device& home = *devices_[c.ordinals[0]];
  DeviceGuard guard(home.ordinal);
  DFCCL_CUDA(cudaMemcpyAsync(c.table, t.get(), sizeof(MatchTable), cudaMemcpyHostToDevice, home.aux));
  DFCCL_CUDA(cudaStreamSynchronize(home.aux));
}

int Runtime::OrdinalOf(int64_t global) const {
  if (ordinal_of_.empty()) return static_cast<int>(global);  // one process: ids are ordinals
  auto it = ordinal_of_.find(global);
  return it == ordinal_of_.end() ? -1 : it->second;
}

int64_t Runtime::GlobalOf(int ordinal) const {
  if (global_of_.empty()) return ordinal;
  auto it = global_of_.find(ordinal);
  return it == global_of_.end() ? -1 : it->second;
}

void Runtime::SetDeviceIds(const std::vector<std::pair<int64_t, int>>& ids) {
  std::lock_guard lk(mu_);
  DFCCL_CHECK(comms_.empty(), "dfccl: device ids must be set before the first collective");
  for (auto [g, o] : ids) { ordinal_of_[g] = o; global_of_[o] = g; }
}

// A communicator's host object and geometry; no device memory yet.
std::unique_ptr<Comm> Runtime::NewComm(const std::vector<int64_t>& group, bool cross) {
  const int n = static_cast<int>(group.size());
  DFCCL_CHECK(n >= 1 && n <= kMaxRanks, "dfccl: groups of " << n << " GPUs are not supported (max " << kMaxRanks << ")");
  auto c = std::make_unique<Comm>();
  c->n = n;
  c->globals = group;
  c->cross_process = cross;
  std::vector<int> local;
  for (auto g : group) {
    c->ordinals.push_back(OrdinalOf(g));
    if (c->ordinals.back() >= 0) local.push_back(c->ordinals.back());
  }
  DFCCL_CHECK(!local.empty(), "dfccl: no device of group [" << (group.empty() ? -1 : group[0]) << ", ...] is in this process");
  c->io_ordinal = local[0];
  for (int a : local) GetDevice(a);
  {
    DeviceGuard guard;
    for (int a : local) {
      DFCCL_CUDA(cudaSetDevice(a));
      EnablePeerAccess(a, local);
    }
  }
  c->view.nranks = n;
  c->view.identity = cfg_.small_by_identity ? 1 : 0;
  // Across processes the peers' XLA buffers are reached through their exported
  // allocations (runtime/ipc.h) once this process listens for them; else staged.
  c->direct = cfg_.direct && (!cross || ipc_.started());
  const PoolGeom geoms[kNumPools] = {
      PoolGeom{cfg_.small_lanes, 1, cfg_.small_slots, 0, cfg_.small_chunk},
      PoolGeom{cfg_.large_lanes, cfg_.large_depth, c->direct ? cfg_.direct_slots : cfg_.large_slots, 0,
               cfg_.large_chunk}};
  for (int p = 0; p < kNumPools; ++p) {
    DFCCL_CHECK(geoms[p].nslots >= 1 && geoms[p].nslots <= kMaxPoolSlots,
                "dfccl: " << geoms[p].nslots << " instance slots (1.." << kMaxPoolSlots << ")");
    c->view.pool[p] = geoms[p];
  }
  return c;
}

// Rank r's device memory (its staging, flags, credits, mailbox; rank 0 also the
// match table), on its device, which is local.
void Runtime::AllocRank(Comm& c, int r) {
  const int ord = c.ordinals[r];
  DeviceGuard guard(ord);
  const int n = c.n;
  for (int p = 0; p < kNumPools; ++p) {
    const PoolGeom& g = c.view.pool[p];
    const size_t cells = static_cast<size_t>(g.nslots) * n * g.lanes;
    // The direct path needs no staging, only flags, credits and the address mailbox.
    const bool staged = p == 0 || !c.direct;
    const size_t stage = staged ? cells * g.depth * g.chunk_bytes : 0, flags = cells * sizeof(uint64_t);
    const size_t mail = p == 1 ? static_cast<size_t>(g.nslots) * n * 2 * sizeof(uint64_t) : 0;
    void *s = nullptr, *f = nullptr, *cr = nullptr, *m = nullptr;
    if (stage) DFCCL_CUDA(cudaMalloc(&s, stage));
    if (stage && p == 0) DFCCL_CUDA(cudaMemsetAsync(s, 0, stage, devices_[ord]->aux));  // LL tags are never 0
    if (mail) {
      DFCCL_CUDA(cudaMalloc(&m, mail));
      c.allocs.push_back({ord, m});
      c.view.mail[r] = static_cast<uint64_t*>(m);
    }
    DFCCL_CUDA(cudaMalloc(&f, flags));
    DFCCL_CUDA(cudaMalloc(&cr, flags));
    DFCCL_CUDA(cudaMemsetAsync(f, 0, flags, devices_[ord]->aux));
    DFCCL_CUDA(cudaMemsetAsync(cr, 0, flags, devices_[ord]->aux));
    DFCCL_CUDA(cudaStreamSynchronize(devices_[ord]->aux));
    if (s) c.allocs.push_back({ord, s});
    c.allocs.insert(c.allocs.end(), {{ord, f}, {ord, cr}});
    c.bytes += stage + 2 * flags + mail;
    c.view.stage[p][r] = static_cast<char*>(s);
    c.view.flags[p][r] = static_cast<uint64_t*>(f);
    c.view.credits[p][r] = static_cast<uint64_t*>(cr);
  }
  if (r == 0) {  // the match table, in rank 0's device memory (the others reach it by peer access or IPC)
    void* t = nullptr;
    DFCCL_CUDA(cudaMalloc(&t, sizeof(MatchTable)));
    c.allocs.push_back({ord, t});
    c.bytes += sizeof(MatchTable);
    c.table = static_cast<MatchTable*>(t);
    c.view.table = c.table;
    InitTable(c);
  }
}

// Every rank's pointers are in the view: a copy of it on each local rank's device.
void Runtime::Publish(Comm& c) {
  c.dev_copy.assign(c.n, nullptr);
  for (int r = 0; r < c.n; ++r) {
    const int ord = c.ordinals[r];
    if (ord < 0) continue;
    // Ranks of other processes on the direct path: their range tables as this GPU reads them.
    CommDev view = c.view;
    for (int q = 0; q < c.n && q < static_cast<int>(c.procs.size()); ++q)
      if (!c.procs[q].empty()) view.xmap[q] = ipc_.AddPeer(c.procs[q], ord);
    DeviceGuard guard(ord);
    CommDev* p = nullptr;
    DFCCL_CUDA(cudaMalloc(&p, sizeof(CommDev)));
    DFCCL_CUDA(cudaMemcpyAsync(p, &view, sizeof(CommDev), cudaMemcpyHostToDevice, devices_[ord]->aux));
    DFCCL_CUDA(cudaStreamSynchronize(devices_[ord]->aux));
    c.dev_copy[r] = p;
    c.allocs.push_back({ord, p});
    c.bytes += sizeof(CommDev);
  }
  c.ready = true;
}

Comm& Runtime::GetComm(const std::vector<int64_t>& group) {
  auto it = comms_.find(group);
  if (it != comms_.end()) {
    DFCCL_CHECK_CODE(it->second->ready, ErrorCode::kFailedPrecondition,
                     "dfccl: the group of devices [" << GroupText(group) << "] spans processes and its memory "
                     "was not exchanged yet (jax_dfccl.initialize() in every process, then the program is "
                     "lowered in every process)");
    return *it->second;
  }
  for (auto g : group)
    DFCCL_CHECK_CODE(OrdinalOf(g) >= 0, ErrorCode::kFailedPrecondition,
                     "dfccl: the group of devices [" << GroupText(group) << "] spans processes: call "
                     "jax_dfccl.initialize() after jax.distributed.initialize() in every process");
  auto c = NewComm(group, false);
  for (int r = 0; r < c->n; ++r) AllocRank(*c, r);
  Publish(*c);
  auto& ref = *c;
  comms_[group] = std::move(c);
  return ref;
}

std::string GroupText(const std::vector<int64_t>& group) {
  std::string s;
  for (size_t i = 0; i < group.size(); ++i) s += (i ? "," : "") + std::to_string(group[i]);
  return s;
}

// The pointers of rank r a blob carries: per pool stage, flags, credits; mail; table.
static std::vector<void**> RankSlots(Comm& c, int r) {
  std::vector<void**> v;
  for (int p = 0; p < kNumPools; ++p) {
    v.push_back(reinterpret_cast<void**>(&c.view.stage[p][r]));
    v.push_back(reinterpret_cast<void**>(&c.view.flags[p][r]));
    v.push_back(reinterpret_cast<void**>(&c.view.credits[p][r]));
  }
  v.push_back(reinterpret_cast<void**>(&c.view.mail[r]));
  if (r == 0) v.push_back(reinterpret_cast<void**>(&c.view.table));
  return v;
}
static constexpr int kBlobSlots = 3 * kNumPools + 2;

// Which processes can see each other's pids: the same boot of the same machine and
// the same pid namespace.
static uint64_t PidSpace() {
  std::string boot, ns(64, '\0');
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  const ssize_t n = readlink("/proc/self/ns/pid", ns.data(), ns.size());
  ns.resize(n > 0 ? n : 0);
  return HashString(boot + "/" + ns);
}

// A blob: per slot a flag, per slot an IPC handle, then the exporter's pid and
// pid space, its pools' protocols (bit 0: pool 1 direct, bit 1: pool 0 by identity),
// and the name its process listens at (runtime/ipc.h).
static constexpr size_t kBlobHandles = kBlobSlots * sizeof(int32_t);
static constexpr size_t kBlobTail = kBlobHandles + kBlobSlots * sizeof(cudaIpcMemHandle_t);
static constexpr size_t kBlobDirect = kBlobTail + sizeof(int32_t) + sizeof(uint64_t);
static constexpr size_t kBlobName = kBlobDirect + sizeof(int32_t), kBlobNameBytes = 96;
static constexpr size_t kBlobBytes = kBlobName + kBlobNameBytes;

void Runtime::StartIpc(const std::string& name) {
  std::lock_guard lk(mu_);
  std::vector<int> ordinals;
  for (auto& [g, o] : ordinal_of_) ordinals.push_back(o);
  DFCCL_CHECK(!ordinals.empty(), "dfccl: set_device_ids before start_ipc");
  DFCCL_CHECK(name.size() < kBlobNameBytes, "dfccl: socket name too long: " << name);
  ipc_.Start(name, ordinals);
}

std::string Runtime::CanExport(int ordinal, const void* p) {
  DeviceGuard guard(ordinal);
  return Ipc::CanExport(p);
}

std::string Runtime::ExportComm(const std::vector<int64_t>& group, int rank) {
  std::lock_guard lk(mu_);
  auto it = comms_.find(group);
  if (it == comms_.end()) it = comms_.emplace(group, NewComm(group, true)).first;
  Comm& c = *it->second;
  DFCCL_CHECK(rank >= 0 && rank < c.n && c.ordinals[rank] >= 0, "dfccl: rank " << rank << " is not local");
  AllocRank(c, rank);
  std::string blob(kBlobBytes, '\0');
  auto slots = RankSlots(c, rank);
  DeviceGuard guard(c.ordinals[rank]);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (*slots[i] == nullptr) continue;
    int32_t one = 1;
    cudaIpcMemHandle_t h;
    DFCCL_CUDA(cudaIpcGetMemHandle(&h, *slots[i]));
    std::memcpy(&blob[i * sizeof(int32_t)], &one, sizeof(one));
    std::memcpy(&blob[kBlobHandles + i * sizeof(h)], &h, sizeof(h));
  }
  const int32_t pid = static_cast<int32_t>(getpid());
  const uint64_t space = PidSpace();
  std::memcpy(&blob[kBlobTail], &pid, sizeof(pid));
  std::memcpy(&blob[kBlobTail + sizeof(pid)], &space, sizeof(space));
  const int32_t modes = (c.direct ? 1 : 0) | (c.view.identity ? 2 : 0);
  const std::string name = ipc_.name();
  std::memcpy(&blob[kBlobDirect], &modes, sizeof(modes));
  std::memcpy(&blob[kBlobName], name.data(), name.size());
  return blob;
}

void Runtime::ImportComm(const std::vector<int64_t>& group, const std::vector<std::string>& blobs) {
  std::lock_guard lk(mu_);
  auto it = comms_.find(group);
  DFCCL_CHECK(it != comms_.end(), "dfccl: import of a group this process did not export");
  Comm& c = *it->second;
  DFCCL_CHECK(static_cast<int>(blobs.size()) == c.n, "dfccl: one blob per rank");
  DeviceGuard guard(c.io_ordinal);
  const uint64_t space = PidSpace();
  c.pids.assign(c.n, 0);
  c.procs.assign(c.n, "");
  for (int r = 0; r < c.n; ++r) {
    if (c.ordinals[r] >= 0) continue;  // local: already in the view
    DFCCL_CHECK(blobs[r].size() == kBlobBytes, "dfccl: rank " << r << "'s exchange blob has " << blobs[r].size()
                                                  << " bytes, not " << kBlobBytes << " (another jax_dfccl build?)");
    int32_t pid = 0;
    uint64_t theirs = 0;
    std::memcpy(&pid, &blobs[r][kBlobTail], sizeof(pid));
    std::memcpy(&theirs, &blobs[r][kBlobTail + sizeof(pid)], sizeof(theirs));
    if (theirs == space) c.pids[r] = pid;
    int32_t modes = 0;
    std::memcpy(&modes, &blobs[r][kBlobDirect], sizeof(modes));
    const int32_t direct = modes & 1, identity = (modes >> 1) & 1;
    DFCCL_CHECK(identity == c.view.identity,
                "dfccl: the group of devices [" << GroupText(group) << "]: rank " << r << "'s process "
                << (identity ? "matches" : "does not match") << " small collectives by identity, this one "
                << (c.view.identity ? "does" : "does not") << " (jax_dfccl.config.tuning.small_by_identity must agree)");
    DFCCL_CHECK(direct == (c.direct ? 1 : 0),
                "dfccl: the group of devices [" << GroupText(group) << "]: rank " << r << "'s process "
                << (direct ? "takes" : "does not take") << " the direct path across processes, this one "
                << (c.direct ? "does" : "does not") << " (jax_dfccl.config.tuning.direct, or XLA's memory cannot be "
                << "exported in one of them: see jax_dfccl.initialize)");
    if (c.direct) c.procs[r].assign(&blobs[r][kBlobName], strnlen(&blobs[r][kBlobName], kBlobNameBytes));
    auto slots = RankSlots(c, r);
    for (size_t i = 0; i < slots.size(); ++i) {
      int32_t has = 0;
      std::memcpy(&has, &blobs[r][i * sizeof(int32_t)], sizeof(has));
      if (!has) continue;
      cudaIpcMemHandle_t h;
      std::memcpy(&h, &blobs[r][kBlobHandles + i * sizeof(h)], sizeof(h));
      void* ptr = nullptr;
      DFCCL_CUDA(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess));
      c.opened.push_back(ptr);
      *slots[i] = ptr;
    }
  }
  c.table = c.view.table;
  Publish(c);
}

// The copy-engine path's host matching: the instance of (key, seq), created by
// its first rank; later ranks must agree on its signature.
Instance* Runtime::Join(Comm& c, const CollectiveSpec& spec, const std::string& sig, uint64_t seq) {
  const auto id = std::make_pair(spec.key_hash, seq);
  if (auto f = c.failed.find(id); f != c.failed.end()) {
    throw Error("dfccl: collective '" + spec.key + "' (sequence " + std::to_string(seq) +
                ") already failed on another rank", ErrorCode::kAborted);
  }
  auto it = c.live.find(id);
  if (it == c.live.end()) {
    auto inst = std::make_unique<Instance>();
    inst->key_hash = spec.key_hash;
    inst->seq = seq;
    inst->key = spec.key;
    inst->signature = sig;
    inst->nranks = c.n;
    it = c.live.emplace(id, std::move(inst)).first;
  }
  Instance* inst = it->second.get();
  if (inst->signature != sig) {
    throw Error("dfccl: collective '" + spec.key + "' (sequence " + std::to_string(seq) + "): rank " +
                    std::to_string(spec.rank) + " started it as " + sig + " but another rank as " + inst->signature,
                ErrorCode::kFailedPrecondition);
  }
  if (inst->started & (1u << spec.rank)) {
    throw Error("dfccl: collective '" + spec.key + "' started twice by rank " + std::to_string(spec.rank),
                ErrorCode::kFailedPrecondition);
  }
  return inst;
}

}  // namespace dfccl::gpu
