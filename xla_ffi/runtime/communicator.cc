// Communicator (communicator.h): geometry, device memory (staging pools, flags,
// credits, mailboxes, the match table), the view's device copies, the exchange
// across processes (CUDA IPC blobs), the failure record of its instances.
// Lock: every function runs under Context::mu (the caller holds it).
#include "runtime/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "device/daemon.h"
#include "dfccl/check.h"
#include "dfccl/host.h"
#include "runtime/driver.h"

#define DFCCL_CUDA(call) DFCCL_CHECK_CUDA(call, "dfccl")

namespace dfccl::gpu {

namespace {
// Protocol "announce": every rank's region (transport/announce_layout.cuh).  A
// rank may have kAnnounceTasks instances of the group in flight (the next start is
// refused, RESOURCE_EXHAUSTED); a message (a rank's input) is at most one receive
// slot's section.
constexpr int kAnnounceDepth = 64, kAnnounceTasks = 16, kAnnounceSlots = 16;
constexpr uint32_t kAnnounceSlotBytes = 64 << 10;
constexpr double kAnnounceGraceS = 1.0;  // past its deadline, a rank waits this long for the home's verdict
}  // namespace

Communicator::Communicator(Context& ctx, const std::vector<int64_t>& group, bool cross, bool spans_hosts)
    : ctx_(ctx) {
  n = static_cast<int>(group.size());
  DFCCL_CHECK(n >= 1 && n <= kMaxRanks, "dfccl: groups of " << n << " GPUs are not supported (max " << kMaxRanks << ")");
  globals = group;
  cross_process = cross;
  std::vector<int> local;
  for (auto g : group) {
    ordinals.push_back(ctx_.OrdinalOf(g));
    if (ordinals.back() >= 0) local.push_back(ordinals.back());
  }
  DFCCL_CHECK(!local.empty(), "dfccl: no device of group [" << (group.empty() ? -1 : group[0]) << ", ...] is in this process");
  io_ordinal = local[0];
  for (int a : local) ctx_.GetDevice(a);
  {
    DeviceGuard guard;
    for (int a : local) {
      DFCCL_CUDA(cudaSetDevice(a));
      EnablePeerAccess(a, local);
    }
  }
  const Config& cfg = ctx_.cfg;
  view.nranks = n;
  announce = spans_hosts;
  announce_bytes = announce ? kAnnounceSlotBytes : 0;
  symmetric = announce && ctx_.engine->pe() >= 0;
  ann_at.assign(n, 0);
  ann_pe.assign(n, -1);
  view.identity = cfg.small_by_identity && !announce ? 1 : 0;
  // Across processes the peers' XLA buffers are reached through their exported
  // allocations (runtime/ipc.h) once this process listens for them; else staged.
  // Across hosts no such mapping exists.
  direct = cfg.direct && !announce && (!cross || ctx_.ipc.started());
  const PoolGeom geoms[kNumPools] = {
      PoolGeom{cfg.small_lanes, 1, cfg.small_slots, 0, cfg.small_chunk},
      PoolGeom{cfg.large_lanes, cfg.large_depth, direct ? cfg.direct_slots : cfg.large_slots, 0,
               cfg.large_chunk}};
  for (int p = 0; p < kNumPools; ++p) {
    DFCCL_CHECK(geoms[p].nslots >= 1 && geoms[p].nslots <= kMaxPoolSlots,
                "dfccl: " << geoms[p].nslots << " instance slots (1.." << kMaxPoolSlots << ")");
    view.pool[p] = geoms[p];
  }
}

void Communicator::InitTable() {
  auto t = std::make_unique<MatchTable>();
  std::memset(static_cast<void*>(t.get()), 0, sizeof(MatchTable));
  for (int p = 0; p < kNumPools; ++p)
    for (int i = 0; i < view.pool[p].nslots; ++i) t->free_bits[p][i / 64] |= 1ull << (i % 64);
  DFCCL_CHECK(ordinals[0] >= 0, "dfccl: the match table is another process's");
  Device& home = *ctx_.devices[ordinals[0]];
  DeviceGuard guard(home.ordinal);
  DFCCL_CUDA(cudaMemcpyAsync(table, t.get(), sizeof(MatchTable), cudaMemcpyHostToDevice, home.aux));
  DFCCL_CUDA(cudaStreamSynchronize(home.aux));
}

// Rank r's device memory (its staging, flags, credits, mailbox; rank 0 also the
// match table), on its device, which is local.
void Communicator::AllocRank(int r) {
  const int ord = ordinals[r];
  DeviceGuard guard(ord);
  Device& d = *ctx_.devices[ord];
  for (int p = 0; p < kNumPools; ++p) {
    const PoolGeom& g = view.pool[p];
    const size_t cells = static_cast<size_t>(g.nslots) * n * g.lanes;
    // The direct path needs no staging, only flags, credits and the address mailbox.
    const bool staged = p == 0 || !direct;
    const size_t stage = staged ? cells * g.depth * g.chunk_bytes : 0, flags = cells * sizeof(uint64_t);
    const size_t mail = p == 1 ? static_cast<size_t>(g.nslots) * n * 2 * sizeof(uint64_t) : 0;
    void *s = nullptr, *f = nullptr, *cr = nullptr, *m = nullptr;
    if (stage) DFCCL_CUDA(cudaMalloc(&s, stage));
    if (stage && p == 0) DFCCL_CUDA(cudaMemsetAsync(s, 0, stage, d.aux));  // LL tags are never 0
    if (mail) {
      DFCCL_CUDA(cudaMalloc(&m, mail));
      allocs.push_back({ord, m});
      view.mail[r] = static_cast<uint64_t*>(m);
    }
    DFCCL_CUDA(cudaMalloc(&f, flags));
    DFCCL_CUDA(cudaMalloc(&cr, flags));
    DFCCL_CUDA(cudaMemsetAsync(f, 0, flags, d.aux));
    DFCCL_CUDA(cudaMemsetAsync(cr, 0, flags, d.aux));
    DFCCL_CUDA(cudaStreamSynchronize(d.aux));
    if (s) allocs.push_back({ord, s});
    allocs.insert(allocs.end(), {{ord, f}, {ord, cr}});
    bytes += stage + 2 * flags + mail;
    view.stage[p][r] = static_cast<char*>(s);
    view.flags[p][r] = static_cast<uint64_t*>(f);
    view.credits[p][r] = static_cast<uint64_t*>(cr);
  }
  if (announce) {  // its region (protocol "announce"): zero, its own state written at Publish
    AnnounceSetup s = AnnounceSetupOf(r);
    const uint64_t b = ctx_.engine->region_bytes(s);
    void* a = nullptr;
    if (symmetric) {  // from the engine's symmetric allocation (zeroed), at an offset the blob carries
      a = ctx_.engine->region_alloc(b, &ann_at[r]);
      ann_pe[r] = ctx_.engine->pe();
    } else {
      DFCCL_CUDA(cudaMalloc(&a, b));
      DFCCL_CUDA(cudaMemsetAsync(a, 0, b, d.aux));
      DFCCL_CUDA(cudaStreamSynchronize(d.aux));
      allocs.push_back({ord, a});
    }
    bytes += static_cast<int64_t>(b);
    view.ann_region[r] = static_cast<char*>(a);
  }
  if (r == 0) {  // the match table, in rank 0's device memory (the others reach it by peer access or IPC)
    void* t = nullptr;
    DFCCL_CUDA(cudaMalloc(&t, sizeof(MatchTable)));
    allocs.push_back({ord, t});
    bytes += sizeof(MatchTable);
    table = static_cast<MatchTable*>(t);
    view.table = table;
    InitTable();
  }
}

void Communicator::Publish() {
  dev_copy.assign(n, nullptr);
  for (int r = 0; r < n; ++r) {
    const int ord = ordinals[r];
    if (ord < 0) continue;
    // Ranks of other processes on the direct path: their range tables as this GPU reads them.
    DeviceHandle v = view;
    for (int q = 0; q < n && q < static_cast<int>(procs.size()); ++q)
      if (!procs[q].empty()) v.xmap[q] = ctx_.ipc.AddPeer(procs[q], ord);
    DeviceGuard guard(ord);
    if (announce) {  // this rank's view of the members' regions, its region's own state
      void* av = nullptr;
      DFCCL_CUDA(cudaMalloc(&av, ctx_.engine->view_bytes()));
      allocs.push_back({ord, av});
      bytes += static_cast<int64_t>(ctx_.engine->view_bytes());
      DFCCL_CUDA(ctx_.engine->announce_init(AnnounceSetupOf(r), av, ctx_.devices[ord]->aux));
      DFCCL_CUDA(cudaStreamSynchronize(ctx_.devices[ord]->aux));
      v.ann = static_cast<const AnnounceView*>(av);
      ann_views.resize(n, nullptr);
      ann_views[r] = av;
    }
    DeviceHandle* p = nullptr;
    DFCCL_CUDA(cudaMalloc(&p, sizeof(DeviceHandle)));
    DFCCL_CUDA(cudaMemcpyAsync(p, &v, sizeof(DeviceHandle), cudaMemcpyHostToDevice, ctx_.devices[ord]->aux));
    DFCCL_CUDA(cudaStreamSynchronize(ctx_.devices[ord]->aux));
    dev_copy[r] = p;
    allocs.push_back({ord, p});
    bytes += sizeof(DeviceHandle);
  }
  ready = true;
}

// The pointers of rank r a blob carries: per pool stage, flags, credits; mail; table.
static std::vector<void**> RankSlots(CommDev& view, int r) {
  std::vector<void**> v;
  for (int p = 0; p < kNumPools; ++p) {
    v.push_back(reinterpret_cast<void**>(&view.stage[p][r]));
    v.push_back(reinterpret_cast<void**>(&view.flags[p][r]));
    v.push_back(reinterpret_cast<void**>(&view.credits[p][r]));
  }
  v.push_back(reinterpret_cast<void**>(&view.mail[r]));
  v.push_back(reinterpret_cast<void**>(&view.ann_region[r]));
  if (r == 0) v.push_back(reinterpret_cast<void**>(&view.table));
  return v;
}
static constexpr int kBlobSlots = 3 * kNumPools + 3;

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
static constexpr size_t kBlobName = kBlobDirect + sizeof(int32_t), kBlobNameBytes = Communicator::kNameBytes;
static constexpr size_t kBlobUuid = kBlobName + kBlobNameBytes;  // the rank's GPU (cudaDeviceProp::uuid)
// Protocol "announce" over a symmetric allocation (NVSHMEM): the rank's PE, its region's offset.
static constexpr size_t kBlobPe = kBlobUuid + sizeof(cudaUUID_t), kBlobAt = kBlobPe + sizeof(int32_t);
static constexpr size_t kBlobBytes = kBlobAt + sizeof(uint64_t);

namespace {
cudaUUID_t UuidOf(int ordinal) {
  cudaDeviceProp prop;
  DFCCL_CUDA(cudaGetDeviceProperties(&prop, ordinal));
  return prop.uuid;
}
}  // namespace

std::string Communicator::Export(int rank) {
  DFCCL_CHECK(rank >= 0 && rank < n && ordinals[rank] >= 0, "dfccl: rank " << rank << " is not local");
  AllocRank(rank);
  std::string blob(kBlobBytes, '\0');
  auto slots = RankSlots(view, rank);
  DeviceGuard guard(ordinals[rank]);
  for (size_t i = 0; i < slots.size(); ++i) {
    // (over NVSHMEM a group spanning hosts shares no memory by CUDA IPC: its peers
    // may be on other machines, and its regions are reached through the engine)
    if (*slots[i] == nullptr || symmetric) continue;
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
  const int32_t modes = (direct ? 1 : 0) | (view.identity ? 2 : 0) | (announce ? 4 : 0) | (symmetric ? 8 : 0);
  const std::string name = ctx_.ipc.name();
  std::memcpy(&blob[kBlobDirect], &modes, sizeof(modes));
  std::memcpy(&blob[kBlobName], name.data(), name.size());
  const cudaUUID_t uuid = UuidOf(ordinals[rank]);
  std::memcpy(&blob[kBlobUuid], &uuid, sizeof(uuid));
  std::memcpy(&blob[kBlobPe], &ann_pe[rank], sizeof(int32_t));
  std::memcpy(&blob[kBlobAt], &ann_at[rank], sizeof(uint64_t));
  return blob;
}

void Communicator::Import(const std::vector<std::string>& blobs) {
  const std::vector<int64_t>& group = globals;
  DFCCL_CHECK(static_cast<int>(blobs.size()) == n, "dfccl: one blob per rank");
  DeviceGuard guard(io_ordinal);
  const uint64_t space = PidSpace();
  pids.assign(n, 0);
  procs.assign(n, "");
  for (int r = 0; r < n; ++r) {
    if (ordinals[r] >= 0) continue;  // local: already in the view
    DFCCL_CHECK(blobs[r].size() == kBlobBytes, "dfccl: rank " << r << "'s exchange blob has " << blobs[r].size()
                                                  << " bytes, not " << kBlobBytes << " (another jax_dfccl build?)");
    int32_t pid = 0;
    uint64_t theirs = 0;
    std::memcpy(&pid, &blobs[r][kBlobTail], sizeof(pid));
    std::memcpy(&theirs, &blobs[r][kBlobTail + sizeof(pid)], sizeof(theirs));
    if (theirs == space) pids[r] = pid;
    int32_t modes = 0;
    std::memcpy(&modes, &blobs[r][kBlobDirect], sizeof(modes));
    const int32_t direct_r = modes & 1, identity = (modes >> 1) & 1, announce_r = (modes >> 2) & 1,
                  symmetric_r = (modes >> 3) & 1;
    DFCCL_CHECK(announce_r == (announce ? 1 : 0),
                "dfccl: the group of devices [" << GroupText(group) << "]: rank " << r << "'s process "
                << (announce_r ? "counts" : "does not count") << " it as spanning hosts, this one "
                << (announce ? "does" : "does not") << " (jax_dfccl.config.testing.processes_per_host must agree)");
    DFCCL_CHECK(!announce || symmetric_r == (symmetric ? 1 : 0),
                "dfccl: the group of devices [" << GroupText(group) << "] spans hosts: rank " << r << "'s process "
                << "reaches its peers " << (symmetric_r ? "over NVSHMEM" : "by CUDA IPC") << ", this one "
                << (symmetric ? "over NVSHMEM" : "by CUDA IPC")
                << " (jax_dfccl.config.cross_host_transport must agree, and NVSHMEM be set up in every process)");
    std::memcpy(&ann_pe[r], &blobs[r][kBlobPe], sizeof(int32_t));
    std::memcpy(&ann_at[r], &blobs[r][kBlobAt], sizeof(uint64_t));
    DFCCL_CHECK(identity == view.identity,
                "dfccl: the group of devices [" << GroupText(group) << "]: rank " << r << "'s process "
                << (identity ? "matches" : "does not match") << " small collectives by identity, this one "
                << (view.identity ? "does" : "does not") << " (jax_dfccl.config.tuning.small_by_identity must agree)");
    DFCCL_CHECK(direct_r == (direct ? 1 : 0),
                "dfccl: the group of devices [" << GroupText(group) << "]: rank " << r << "'s process "
                << (direct_r ? "takes" : "does not take") << " the direct path across processes, this one "
                << (direct ? "does" : "does not") << " (jax_dfccl.config.tuning.direct, or XLA's memory cannot be "
                << "exported in one of them: see jax_dfccl.initialize)");
    if (direct) procs[r].assign(&blobs[r][kBlobName], strnlen(&blobs[r][kBlobName], kBlobNameBytes));
    auto slots = RankSlots(view, r);
    for (size_t i = 0; i < slots.size(); ++i) {
      int32_t has = 0;
      std::memcpy(&has, &blobs[r][i * sizeof(int32_t)], sizeof(has));
      if (!has) continue;
      cudaIpcMemHandle_t h;
      std::memcpy(&h, &blobs[r][kBlobHandles + i * sizeof(h)], sizeof(h));
      void* ptr = nullptr;
      DFCCL_CUDA(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess));
      opened.push_back(ptr);
      *slots[i] = ptr;
    }
  }
  // Processes of this host with a rank on the GPU of a local rank (MPS): the
  // daemons there share its SMs (Context::SetSharing).
  for (int a = 0; a < n; ++a) {
    if (ordinals[a] < 0) continue;
    const cudaUUID_t mine = UuidOf(ordinals[a]);
    std::vector<int32_t> others;
    for (int r = 0; r < n; ++r)
      if (ordinals[r] < 0 && pids[r] != 0 && std::memcmp(&blobs[r][kBlobUuid], &mine, sizeof(mine)) == 0 &&
          std::find(others.begin(), others.end(), pids[r]) == others.end())
        others.push_back(pids[r]);
    ctx_.SetSharing(ctx_.GetDevice(ordinals[a]), 1 + static_cast<int>(others.size()));
  }
  table = view.table;
  Publish();
}

AnnounceSetup Communicator::AnnounceSetupOf(int r) const {
  AnnounceSetup s;
  s.rank = r;
  s.nranks = n;
  s.depth = kAnnounceDepth;
  s.tasks = kAnnounceTasks;
  // >= every member's instances in flight, and tombstones; a power of two (the
  // table's index is then a mask: transport/announce.cuh Home)
  s.entries = 64;
  while (s.entries < 2 * n * kAnnounceTasks) s.entries *= 2;
  s.slots = kAnnounceSlots;
  s.slot_bytes = kAnnounceSlotBytes;
  s.group = static_cast<uint32_t>(HashString(GroupText(globals)));
  s.timeout_ns = static_cast<uint64_t>(ctx_.cfg.timeout_s * 1e9);
  s.grace_ns = static_cast<uint64_t>(kAnnounceGraceS * 1e9);
  for (int q = 0; q < n && static_cast<int>(hosts.size()) == n; ++q)
    if (hosts[q] != hosts[r]) s.remote |= 1ull << q;
  s.delay_ns = latency_ns;
  for (int q = 0; q < n; ++q) {
    s.regions[q] = view.ann_region[q];
    s.at[q] = ann_at[q];  // (sized at construction)
    s.pe[q] = ann_pe[q];
  }
  return s;
}

double Communicator::AnnounceGraceS() { return kAnnounceGraceS; }
int64_t Communicator::AnnounceMaxBytes() { return kAnnounceSlotBytes; }

void Communicator::SetAnnounceConfig() {
  for (int r = 0; r < static_cast<int>(ann_views.size()); ++r) {
    if (!ann_views[r]) continue;
    DeviceGuard guard(ordinals[r]);
    DFCCL_CUDA(ctx_.engine->set_config(ann_views[r], static_cast<uint64_t>(ctx_.cfg.timeout_s * 1e9),
                                       static_cast<uint64_t>(kAnnounceGraceS * 1e9), ann_generation,
                                       ctx_.devices[ordinals[r]]->aux));
  }
}

void Communicator::Fail(uint64_t key_hash, uint64_t seq, ErrorCode code, const std::string& msg) {
  failed_.insert({key_hash, seq});
  SetError(code, msg);
}

bool Communicator::Failed(uint64_t key_hash, uint64_t seq) const { return failed_.count({key_hash, seq}) != 0; }

void Communicator::ClearFailures() {
  tombstones.clear();
  failed_.clear();
}

std::string Communicator::InstanceName(const std::string& key, uint64_t seq) const {
  std::ostringstream msg;
  msg << "dfccl: collective '" << key << "' (sequence " << seq << ", group of GPUs [";
  for (int i = 0; i < n; ++i) msg << (i ? "," : "") << globals[i];
  msg << "])";
  return msg.str();
}

void Communicator::SetError(ErrorCode code, const std::string& msg) {
  ctx_.RecordError(msg);
  for (int ord : ordinals) {
    if (ord < 0) continue;  // another process's device: its own runtime reports it
    Device& d = *ctx_.devices[ord];
    if (d.error.ok()) {
      d.error = Status{code, msg};
      d.error_once = true;
      d.has_error.store(true, std::memory_order_release);
    }
  }
}

}  // namespace dfccl::gpu
