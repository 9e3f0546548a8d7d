#include "runtime/driver.h"

#include <cuda.h>

#include "dfccl/check.h"

namespace dfccl::gpu {
namespace {

using WriteValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

template <class Fn>
Fn Lookup(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  // Version 12000 selects the _v2 implementation of the stream memory operations.
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status);
  DFCCL_CHECK_CODE(err == cudaSuccess && fn != nullptr && status == cudaDriverEntryPointSuccess, ::dfccl::ErrorCode::kInternal,
              "dfccl: driver entry point " << name << " unavailable (" << cudaGetErrorString(err) << ")");
  return reinterpret_cast<Fn>(fn);
}

struct Table {
  WriteValue32Fn write32 = Lookup<WriteValue32Fn>("cuStreamWriteValue32");
};

// The virtual memory entry points (looked up at the first use: only groups that span processes need them).
struct VmmTable {
  decltype(&cuMemGetAddressRange) range = Lookup<decltype(&cuMemGetAddressRange)>("cuMemGetAddressRange");
  decltype(&cuPointerGetAttribute) attr = Lookup<decltype(&cuPointerGetAttribute)>("cuPointerGetAttribute");
  decltype(&cuMemRetainAllocationHandle) retain =
      Lookup<decltype(&cuMemRetainAllocationHandle)>("cuMemRetainAllocationHandle");
  decltype(&cuMemExportToShareableHandle) export_fd =
      Lookup<decltype(&cuMemExportToShareableHandle)>("cuMemExportToShareableHandle");
  decltype(&cuMemImportFromShareableHandle) import_fd =
      Lookup<decltype(&cuMemImportFromShareableHandle)>("cuMemImportFromShareableHandle");
  decltype(&cuMemAddressReserve) reserve = Lookup<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
  decltype(&cuMemMap) map = Lookup<decltype(&cuMemMap)>("cuMemMap");
  decltype(&cuMemSetAccess) access = Lookup<decltype(&cuMemSetAccess)>("cuMemSetAccess");
  decltype(&cuMemUnmap) unmap = Lookup<decltype(&cuMemUnmap)>("cuMemUnmap");
  decltype(&cuMemAddressFree) free = Lookup<decltype(&cuMemAddressFree)>("cuMemAddressFree");
  decltype(&cuMemRelease) release = Lookup<decltype(&cuMemRelease)>("cuMemRelease");
  decltype(&cuMemCreate) create = Lookup<decltype(&cuMemCreate)>("cuMemCreate");
  decltype(&cuMemGetAllocationGranularity) granularity =
      Lookup<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity");
};

const VmmTable& V() {
  static const VmmTable table;
  return table;
}

const Table& T() {
  static const Table table;
  return table;
}

void Check(CUresult r, const char* what) {
  DFCCL_CHECK_CODE(r == CUDA_SUCCESS, ::dfccl::ErrorCode::kInternal, "dfccl: " << what << " failed with CUresult " << static_cast<int>(r));
}

}  // namespace

Vmm::Range Vmm::RangeOf(const void* p) {
  Range r;
  CUdeviceptr base = 0;
  size_t size = 0;
  Check(V().range(&base, &size, reinterpret_cast<CUdeviceptr>(p)), "cuMemGetAddressRange");
  r.base = base;
  r.size = size;
  unsigned long long id = 0;
  if (V().attr(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, reinterpret_cast<CUdeviceptr>(p)) == CUDA_SUCCESS) r.id = id;
  return r;
}

int Vmm::ExportFd(uint64_t base) {
  CUmemGenericAllocationHandle h = 0;
  Check(V().retain(&h, reinterpret_cast<void*>(base)), "cuMemRetainAllocationHandle");
  int fd = -1;
  const CUresult r = V().export_fd(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  V().release(h);  // the allocation keeps its own reference
  Check(r, "cuMemExportToShareableHandle");
  return fd;
}

Vmm::Mapping Vmm::Import(int fd, uint64_t size, const std::vector<int>& ordinals) {
  Mapping m;
  m.size = size;
  CUmemGenericAllocationHandle h = 0;
  Check(V().import_fd(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        "cuMemImportFromShareableHandle");
  m.handle = h;
  CUdeviceptr va = 0;
  CUresult r = V().reserve(&va, size, 0, 0, 0);
  if (r == CUDA_SUCCESS) {
    m.va = va;
    r = V().map(va, size, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      V().free(va, size);
      m.va = 0;
    }
  }
  if (r != CUDA_SUCCESS) {
    V().release(h);
    Check(r, "cuMemAddressReserve/cuMemMap");
  }
  int granted = 0;
  for (int o : ordinals) {
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = o;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    granted += V().access(va, size, &a, 1) == CUDA_SUCCESS ? 1 : 0;
  }
  if (granted == 0) {
    Unmap(m);
    DFCCL_CHECK_CODE(false, ::dfccl::ErrorCode::kInternal, "dfccl: no local GPU can access an allocation of another process (cuMemSetAccess)");
  }
  return m;
}

Vmm::Mapping Vmm::Create(uint64_t size, int ordinal, const std::vector<int>& access) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  Check(V().granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity");
  Mapping m;
  m.size = (size + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle h = 0;
  Check(V().create(&h, m.size, &prop, 0), "cuMemCreate");
  m.handle = h;
  CUdeviceptr va = 0;
  CUresult r = V().reserve(&va, m.size, 0, 0, 0);
  if (r == CUDA_SUCCESS) {
    m.va = va;
    r = V().map(va, m.size, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      V().free(va, m.size);
      m.va = 0;
    }
  }
  if (r == CUDA_SUCCESS) {
    std::vector<CUmemAccessDesc> a(1);
    a[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a[0].location.id = ordinal;
    a[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (int o : access)
      if (o != ordinal) a.push_back(a[0]), a.back().location.id = o;
    r = V().access(va, m.size, a.data(), a.size());
    if (r != CUDA_SUCCESS) {
      V().unmap(va, m.size);
      V().free(va, m.size);
      m.va = 0;
    }
  }
  if (r != CUDA_SUCCESS) {
    V().release(h);
    Check(r, "cuMemAddressReserve/cuMemMap/cuMemSetAccess");
  }
  return m;
}

void Vmm::Unmap(const Mapping& m) noexcept {
  if (m.va) {
    V().unmap(m.va, m.size);
    V().free(m.va, m.size);
  }
  if (m.handle) V().release(m.handle);
}

void StreamOps::Write32(cudaStream_t s, void* addr, uint32_t v) {
  Check(T().write32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(addr), v,
                    CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32_v2");
}
DeviceGuard::DeviceGuard(int ordinal) {
  DFCCL_CHECK_CUDA(cudaGetDevice(&prev_), "dfccl");
  if (prev_ == ordinal) return;
  DFCCL_CHECK_CUDA(cudaSetDevice(ordinal), "dfccl");
  restore_ = true;
}

void EnablePeerAccess(int ordinal, const std::vector<int>& peers) {
  for (int b : peers) {
    if (b == ordinal) continue;
    int ok = 0;
    DFCCL_CHECK_CUDA(cudaDeviceCanAccessPeer(&ok, ordinal, b), "dfccl");
    DFCCL_CHECK(ok, "dfccl: GPU " << ordinal << " cannot access GPU " << b << " (peer access required)");
    const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();  // clear it: not sticky
    else DFCCL_CHECK_CODE(e == cudaSuccess, ::dfccl::ErrorCode::kInternal, "dfccl: enabling peer access " << ordinal << "->" << b << ": " << cudaGetErrorString(e));
  }
}

}  // namespace dfccl::gpu
