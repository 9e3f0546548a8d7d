// compute-sanitizer memcheck and a persistent kernel: does memcheck know an allocation made
// after the kernel's launch?  (The daemon reads a start form's site staging, allocated at the
// site's first call, possibly after the daemon was launched; memcheck flags those reads over
// NVSHMEM: docs/design/announce.md.)  Build and run on a GPU machine:
//   nvcc -arch=sm_90a -o /tmp/late_alloc tools/memcheck_late_alloc_probe.cu
//   compute-sanitizer --tool memcheck /tmp/late_alloc
#include <cstdio>
#include <cuda_runtime.h>
__global__ void Persistent(volatile unsigned long long* box, int* out) {
  unsigned long long p = 0;
  const long long t0 = clock64();
  while ((p = *box) == 0)
    if (clock64() - t0 > 20000000000ll) return;  // (bounded: about 10 s)
  const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p) + threadIdx.x);
  out[threadIdx.x] = static_cast<int>(v.x + v.y + v.z + v.w);
}
int main() {
  unsigned long long* box = nullptr;
  cudaHostAlloc(&box, 8, cudaHostAllocMapped);
  *box = 0;
  unsigned long long* dbox = nullptr;
  cudaHostGetDevicePointer(&dbox, box, 0);
  int* out = nullptr;
  cudaMalloc(&out, 32 * sizeof(int));
  cudaStream_t s1, s2;
  cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
  Persistent<<<1, 32, 0, s1>>>(dbox, out);
  char* late = nullptr;
  cudaMalloc(&late, 16640);  // after the launch
  cudaMemsetAsync(late, 1, 16640, s2);
  cudaStreamSynchronize(s2);
  __sync_synchronize();
  *reinterpret_cast<volatile unsigned long long*>(box) = reinterpret_cast<unsigned long long>(late + 256);
  cudaError_t e = cudaStreamSynchronize(s1);
  printf("late allocation read by the running kernel: %s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
