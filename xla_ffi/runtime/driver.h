// CUDA helpers shared by the runtime and the fused overlap ops: the driver's
// stream-ordered 32-bit write, reached through cudaGetDriverEntryPointByVersion
// (no libcuda at link time; on the H200 machines the legacy cuStreamWriteValue32
// entry point returns CUDA_ERROR_NOT_SUPPORTED (801); the _v2 one, CUDA >= 11.7
// ABI, works), the current-device guard and peer access, and the virtual
// memory calls that share XLA's allocations with other processes (Vmm).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace dfccl::gpu {

struct StreamOps {
  // *addr = value once prior work on `stream` is complete (with a memory barrier).
  static void Write32(cudaStream_t stream, void* addr, uint32_t value);
};

// XLA's device memory comes from cuMemCreate allocations: cudaIpcGetMemHandle
// refuses them, but an allocation made with the POSIX file-descriptor handle
// type exports as a file descriptor that another process maps (runtime/ipc.h).
// Every call throws dfccl::Error naming the driver call on failure.
struct Vmm {
  struct Range {
    uint64_t base = 0, size = 0;
    uint64_t id = 0;  // CU_POINTER_ATTRIBUTE_BUFFER_ID (unique in the process; 0: not reported)
  };
  struct Mapping {
    uint64_t va = 0, size = 0, handle = 0;
  };
  static Range RangeOf(const void* p);  // the allocation holding p (the current device's context)
  static int ExportFd(uint64_t base);   // a new file descriptor for the allocation at base
  // Maps an exported allocation of `size` bytes, readable and writable by each of `ordinals`
  // (those that cannot reach it are skipped; none at all throws).  Does not close fd.
  static Mapping Import(int fd, uint64_t size, const std::vector<int>& ordinals);
  // A new allocation of at least `size` bytes on GPU `ordinal`, readable and
  // writable by it and by `access` (GPUs of this process), exportable as a file
  // descriptor (Ipc::Tag shares it like XLA's memory); released by Unmap.
  static Mapping Create(uint64_t size, int ordinal, const std::vector<int>& access);
  static void Unmap(const Mapping& m) noexcept;
};

// DeviceGuard(ordinal): `ordinal` is the current device for the guard's scope
// (set only when it is not already); DeviceGuard(): the scope switches devices
// itself.  Either way the caller's device is restored at the end of the scope.
class DeviceGuard {
 public:
  DeviceGuard() : restore_(true) { cudaGetDevice(&prev_); }
  explicit DeviceGuard(int ordinal);  // throws if the device cannot be made current
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool restore_ = false;
};

// Enables access from the current device `ordinal` to each of `peers` (itself
// skipped; already enabled is fine); throws naming both GPUs if one cannot.
void EnablePeerAccess(int ordinal, const std::vector<int>& peers);

}  // namespace dfccl::gpu
