// The direct path across processes: another process's XLA buffers, reached
// through the allocations that hold them (protocol: device/direct.cuh, task.h
// "direct").
//
//  owner    a start whose buffers a peer process reads or writes tags each
//           buffer with its allocation's range (Tag): the first time it sees a
//           range (cuMemGetAddressRange; a new CU_POINTER_ATTRIBUTE_BUFFER_ID at
//           a known base is a new range: the allocator gave the old one back)
//           it exports the allocation as a POSIX file descriptor (Vmm) and sends
//           (tag, base, size, fd) to every peer process over a Unix socket
//           (SOCK_SEQPACKET, SCM_RIGHTS; abstract names, so nothing is left in
//           the file system); a peer added later gets every live range.
//  peer     a thread per process (Serve) maps each range it receives
//           (cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap,
//           cuMemSetAccess for every local GPU) and publishes it in the owner's
//           range table (XRange[kMaxXRanges] in pinned host memory the GPUs
//           read: plain stores, local_base last); a retired tag is unpublished
//           first, then unmapped.  No stream operation: a copy into device
//           memory waited behind a stream whose kernel waited for that very
//           mapping (streams share CUDA_DEVICE_MAX_CONNECTIONS hardware queues;
//           measured: the serving thread held 20 s in the copy, the collective
//           timed out), so publishing must not depend on the GPU's queues.
//           Each local GPU keeps a cache of the table in its memory, which its
//           lanes fill from the published one on a miss (an entry is written
//           once: tags are never reused), so a lane pays the host round trip
//           once per range, not per chunk (host reads per chunk made 16 MiB
//           psums 3.5x slower).
//  device   a lane reads the owner's tagged address from the mailbox and waits
//           (preemptible, like a late peer) until the tag's entry covers it.
//           Each mapping has a generation (XRange::gen, counted by gen()), each
//           daemon launch the count at its launch (DaemonParams::map_gen): a lane
//           that meets a mapping younger than its daemon makes the daemon leave
//           (DeviceShared::stale_map) and the proxy relaunches it, so no kernel
//           touches memory mapped after its launch (memory checkers check a
//           launch against the mappings that existed then).
//
// So a new range costs its first instance the export and mapping (measured
// ~40 us and 0.2-0.3 ms on an H200), never a wait on another collective.  A
// retired range is unmapped when its owner sees the base again with another
// buffer id: the owner's XLA freed the old buffers, so no instance uses them.
// Every mapping, file descriptor and socket goes with the process (the driver
// releases what a killed process held).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "device/task.h"
#include "runtime/driver.h"

namespace dfccl::gpu {

class Ipc {
 public:
  ~Ipc();
  // Listens at the abstract Unix socket `name` (one per process of the job).
  // `ordinals`: this process's GPUs (those that may access mapped ranges).
  void Start(const std::string& name, const std::vector<int>& ordinals);
  bool started() const { return listen_fd_ >= 0; }
  std::string name() const { return name_; }
  // Whether the allocation holding p (a buffer XLA allocated on the current
  // device) can be exported; "" if so, else why not.
  static std::string CanExport(const void* p);
  // The tag of the range holding p on GPU `ordinal` (exported to every peer on first
  // sight); 0 for a null p.  Throws dfccl::Error.
  int Tag(const void* p, int ordinal);
  // The range table of the process listening at `peer` as GPU `ordinal`'s lanes
  // read it: their cache in its memory, whose entry 0 holds the published
  // table's device address (device/direct.cuh XLocal); from now on this
  // process's ranges are sent there too.
  const XRange* AddPeer(const std::string& peer, int ordinal);
  // Mappings made so far (every XRange::gen is at most this): a kernel launched
  // now may read each of them (DaemonParams::map_gen).
  uint64_t gen() const { return gen_.load(); }
  int64_t exported() const { return exported_; }
  int64_t mapped() const { return mapped_; }
  std::vector<std::string> errors();
  // What the serving thread is doing and for how long ("waiting for ranges" when
  // idle), once started: for pending(), never blocks (a CUDA call it makes may wait).
  std::string Describe() const;

 private:
  struct Export {
    uint64_t size = 0, id = 0;
    int tag = 0, fd = -1;
  };
  struct Table {
    std::vector<XRange> entries;       // the host's copy
    XRange* shared = nullptr;          // the published table (pinned, mapped, portable; written by Publish)
    std::map<int, XRange*> cache;      // by local GPU ordinal: the lanes' cache of it (device memory, filled by them)
    std::map<int, Vmm::Mapping> maps;  // by tag
  };
  struct Msg;
  void SendTo(const std::string& peer, int type, int tag, uint64_t base, uint64_t size, int fd);
  int Connect(const std::string& peer);
  Table& TableOf(const std::string& peer);  // tables_mu_ held
  void Publish(Table& t, int tag);          // tables_mu_ held: entry tag into the shared table (local_base last)
  void Serve();
  void OnMessage(const Msg& m, int fd);  // tables_mu_ held
  void ImportError(const std::string& e);
  void Serving(const char* what);        // the serving thread: what it does from now on

  // mu_: exports and peers (handler threads); tables_mu_: the range tables (the
  // serving thread, which never takes mu_, so a send never waits for an import);
  // import_errors_mu_: import_errors_ only (errors() never waits for an import).
  std::mutex mu_, tables_mu_, import_errors_mu_;
  std::string name_;
  std::vector<int> ordinals_;
  int listen_fd_ = -1, wake_[2] = {-1, -1};
  std::thread thread_;
  std::map<uint64_t, Export> exports_;   // by base
  int next_tag_ = 1;
  std::map<std::string, int> peers_;     // peer name -> connected socket (-1: not reachable)
  std::map<std::string, Table> tables_;  // by owner's name
  std::vector<std::string> errors_, import_errors_;
  std::atomic<int64_t> exported_{0}, mapped_{0};
  std::atomic<uint64_t> gen_{0};
  std::atomic<const char*> serving_in_{"waiting for ranges"};
  std::atomic<int64_t> serving_since_ns_{0};
};

}  // namespace dfccl::gpu
