// compute-sanitizer memcheck and a persistent kernel: which kernels does memcheck let read an
// allocation made while a kernel already runs?  (The daemon reads a start form's site staging,
// allocated at the site's first call, possibly after the daemon was launched: docs/design/announce.md.)
//   mode 0: the running kernel itself reads it (as an old daemon would);
//   mode 1: a kernel launched after the allocation, on another stream, while the first still runs;
//   mode 2: a kernel launched after the allocation, queued on the running kernel's stream
//           (as the daemon's successor is: runtime/daemon_path.cc, a staged site's relaunch).
// Build and run on a GPU machine:
//   nvcc -arch=sm_90a -o /tmp/late_alloc tools/memcheck_late_alloc_probe.cu
//   for m in 0 1 2; do compute-sanitizer --tool memcheck /tmp/late_alloc $m; done
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CHECK(x)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      printf("%s: %s\n", #x, cudaGetErrorString(e_));                                      \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

// Waits (bounded: about 10 s) until *box holds a pointer, then reads 16 bytes per thread through it.
__global__ void Persistent(volatile unsigned long long* box, int* out) {
  unsigned long long p = 0;
  const long long t0 = clock64();
  while ((p = *box) == 0)
    if (clock64() - t0 > 20000000000ll) return;
  if (p == 1) return;  // released without a read (modes 1 and 2)
  const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p) + threadIdx.x);
  out[threadIdx.x] = static_cast<int>(v.x + v.y + v.z + v.w);
}

__global__ void ReadOnce(const char* p, int* out) {
  const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p) + threadIdx.x);
  out[threadIdx.x] = static_cast<int>(v.x + v.y + v.z + v.w);
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 0;
  unsigned long long* box = nullptr;
  CHECK(cudaHostAlloc(&box, 8, cudaHostAllocMapped));
  *box = 0;
  unsigned long long* dbox = nullptr;
  CHECK(cudaHostGetDevicePointer(&dbox, box, 0));
  int* out = nullptr;
  CHECK(cudaMalloc(&out, 32 * sizeof(int)));
  cudaStream_t s1, s2;
  CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  Persistent<<<1, 32, 0, s1>>>(dbox, out);
  CHECK(cudaGetLastError());
  char* late = nullptr;
  CHECK(cudaMalloc(&late, 16640));  // after the launch
  CHECK(cudaMemsetAsync(late, 1, 16640, s2));
  CHECK(cudaStreamSynchronize(s2));
  __sync_synchronize();
  if (mode == 1) ReadOnce<<<1, 32, 0, s2>>>(late + 256, out);
  if (mode == 2) ReadOnce<<<1, 32, 0, s1>>>(late + 256, out);
  CHECK(cudaGetLastError());
  if (mode == 1) {
    const cudaError_t e2 = cudaStreamSynchronize(s2);
    printf("mode 1, a later kernel beside the running one: %s\n", cudaGetErrorString(e2));
  }
  *reinterpret_cast<volatile unsigned long long*>(box) = mode == 0 ? reinterpret_cast<unsigned long long>(late + 256) : 1ull;
  const cudaError_t e = cudaStreamSynchronize(s1);
  printf("mode %d: %s\n", mode, cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
