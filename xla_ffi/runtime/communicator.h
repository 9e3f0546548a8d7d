// One communicator: a group of devices (ranks), its device memory (staging
// pools, flags, credits, mailboxes, the daemon path's match table), the copy of
// its view on each local rank's device (what kernels take: DeviceHandle), its
// set-up and exchange across processes, and the record of its instances'
// failures for every path.
//
// Matching itself stays with each path: the daemon path matches on the device
// (the match table, device/match.cuh), the copy-engine path on the host
// (CopyEnginePath::Join over `live`), the fused ops in their kernels (their
// channel's mailbox and flags, OverlapPath).  An instance (key_hash, seq) fails in one
// place whatever its path: Fail() records it and makes it the error of the
// group's local devices; Failed() looks it up.
//
// Owner: Context::comms (by group).  Lock: everything here is used under
// Context::mu; the device copies of the view are read by the kernels.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dfccl/check.h"
#include "device/daemon.h"
#include "device/task.h"
#include "runtime/context.h"

namespace dfccl::gpu {

// A copy-engine collective instance, matched on the host.
struct Instance {
  uint64_t key_hash = 0, seq = 0;
  std::string key, signature;
  int nranks = 0, done = 0;
  uint32_t started = 0;
  bool failed = false;
  std::vector<std::pair<Device*, uint64_t>> tasks;  // (device, ticket); kCeTicket marks the copy-engine ring
  std::vector<CeRank> ce_ranks;                     // per rank, filled as ranks start (copy-engine path)
};

class Communicator {
 public:
  // What the kernels take (device/task.h): this communicator on the device.
  using DeviceHandle = CommDev;
  using InstanceId = std::pair<uint64_t, uint64_t>;  // (key_hash, seq)

  // The host object and geometry; no device memory yet.
  // announce: the group spans hosts (protocol "announce" in device/task.h: matched
  // by announcements, each rank's region reached through the transport).
  Communicator(Context& ctx, const std::vector<int64_t>& group, bool cross, bool announce = false);
  // Rank r's device memory, on its device, which is local.
  void AllocRank(int r);
  // Every rank's pointers are in the view: a copy of it on each local rank's device.
  void Publish();
  void InitTable();  // the match table empty, every slot free
  // Across processes: a local rank's memory as a blob (CUDA IPC handles), and the
  // other ranks' blobs mapped into the view (then Publish).
  std::string Export(int rank);
  void Import(const std::vector<std::string>& blobs);
  static constexpr size_t kNameBytes = 96;  // a blob's room for the name the process listens at (Ipc)
  // Rank r's device copy of the view (on its device; null for another process's rank).
  DeviceHandle* device_handle(int r) const { return dev_copy[r]; }

  // Failures, every path.  Fail records the instance's failure and makes `msg`
  // the error of the group's local devices (thrown once by their next handler call).
  void Fail(uint64_t key_hash, uint64_t seq, ErrorCode code, const std::string& msg);
  bool Failed(uint64_t key_hash, uint64_t seq) const;
  void ClearFailures();  // reset(): failure records and tombstones
  std::string InstanceName(const std::string& key, uint64_t seq) const;
  // Protocol "announce": rank r's set-up (geometry, deadlines, the members' regions).
  AnnounceSetup AnnounceSetupOf(int r) const;
  static double AnnounceGraceS();  // how long past timeout_s a rank waits for the home's verdict
  static int64_t AnnounceMaxBytes();  // the largest input of a rank of a group spanning hosts
  void SetAnnounceConfig();        // the local ranks' views take config.timeout_s and ann_generation
  // The copy-engine path's sequence number of (local device, key), counted on the host.
  uint64_t NextSeq(int ordinal, uint64_t key_hash) { return ce_seq_[{ordinal, key_hash}]++; }
  void ClearSeqs() { ce_seq_.clear(); }

  std::vector<int> ordinals;  // per rank: the local CUDA ordinal, -1 for a device of another process
  int n = 0;
  bool direct = false;  // pool-1 instances take the direct path (Config::direct when created)
  bool announce = false;  // spans hosts: matched by announcements (no direct path, no identity, no inline run)
  uint32_t announce_bytes = 0;  // then the largest input a rank may send (a receive slot's section)
  DeviceHandle view{};
  std::vector<DeviceHandle*> dev_copy;      // per rank, on its device
  std::vector<std::pair<int, void*>> allocs;
  int64_t bytes = 0;
  // The copy-engine path's host-matched instances: live until every task is done;
  // a failed one then stays as a tombstone (a late rank gets the error).
  std::map<InstanceId, std::unique_ptr<Instance>> live;
  std::map<InstanceId, std::unique_ptr<Instance>> tombstones;
  MatchTable* table = nullptr;  // daemon path: in rank 0's device memory (an IPC mapping in other processes)
  std::vector<int64_t> globals;  // the ranks' global device ids
  bool cross_process = false;    // some rank's device belongs to another process (CUDA IPC)
  bool ready = false;            // every rank's memory is in the view (cross-process: after Import)
  int io_ordinal = 0;            // a local device, for reading the table
  std::vector<void*> opened;     // IPC mappings of the other processes' memory
  std::vector<int32_t> pids;     // per rank: its process's pid when it runs on this host (0: unknown)
  std::vector<std::string> procs;  // per rank of another process on the direct path: where its process listens (ipc.h)
  std::vector<void*> ann_views;    // protocol "announce": per local rank, its view (device memory); else null
  // Protocol "announce" over an engine with a symmetric allocation (NVSHMEM): per rank,
  // its region's offset there and its PE (the local ranks' from the engine, the
  // others' from their blobs).
  std::vector<uint64_t> ann_at;
  std::vector<int32_t> ann_pe;
  // Protocol "announce": each rank's host (empty: not known), and a test setting, the
  // latency of another host simulated by the transport (config.testing.cross_host_latency_us).
  std::vector<int32_t> hosts;
  uint64_t latency_ns = 0;
  uint64_t ann_generation = 0;  // advanced by every reset(): earlier instances' entries never meet later ones
  bool symmetric = false;          // the announced regions are the engine's (Context::engine->pe() >= 0)

 private:
  void SetError(ErrorCode code, const std::string& msg);  // the group's local devices' error

  Context& ctx_;
  std::set<InstanceId> failed_;  // instances whose failure was recorded (either path)
  std::map<std::pair<int, uint64_t>, uint64_t> ce_seq_;  // copy-engine path: (ordinal, key_hash) -> next sequence
};

}  // namespace dfccl::gpu
