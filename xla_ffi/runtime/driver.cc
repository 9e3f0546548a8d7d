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

const Table& T() {
  static const Table table;
  return table;
}

void Check(CUresult r, const char* what) {
  DFCCL_CHECK_CODE(r == CUDA_SUCCESS, ::dfccl::ErrorCode::kInternal, "dfccl: " << what << " failed with CUresult " << static_cast<int>(r));
}

}  // namespace

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
