// Which stages of an XLA FFI handler XLA calls, and when, inside and outside its
// command buffers (the question docs/design/execution_identity.md, "Inside command
// buffers: the plan", rests on).  One custom call target, `probe_stages`, with a
// prepare, an initialize and an execute stage (the execute stage command-buffer
// compatible).  Every call is recorded on the host (stage, launch id, whether the
// stream is capturing, the call site).  The initialize stage also writes the launch
// id into a device word on the stream it is given, and the execute stage enqueues
// a kernel that appends that word to a device log — so the log tells whether a
// captured start, replayed without its handler, reads the launch id of its own
// execution.  Built and run by tools/ffi_stage_probe/run.py.
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Rec {
  int64_t stage;      // 1 prepare, 2 initialize, 3 execute
  int64_t capturing;  // the stream was capturing (-1: no stream at that stage)
  int64_t run;        // the launch id XLA passed
  int64_t site;
};
std::mutex mu;
std::vector<Rec>& recs = *new std::vector<Rec>;

constexpr int kLog = 1 << 16;
__device__ uint32_t d_word;              // the launch id the initialize stage wrote last
__device__ unsigned long long d_n;       // entries in d_log
__device__ uint64_t d_log[kLog];         // (site << 32) | the word, as each execute kernel read it

void Add(int64_t stage, cudaStream_t s, int64_t run, int64_t site) {
  int64_t cap = -1;
  if (s != nullptr) {
    cudaStreamCaptureStatus c = cudaStreamCaptureStatusNone;
    cap = cudaStreamIsCapturing(s, &c) == cudaSuccess ? (c != cudaStreamCaptureStatusNone) : -2;
  }
  std::lock_guard lk(mu);
  recs.push_back(Rec{stage, cap, run, site});
}

__global__ void SetWord(uint32_t v) { d_word = v; }

__global__ void ReadWord(uint64_t site) {
  const unsigned long long i = atomicAdd(&d_n, 1ull);
  if (i < kLog) d_log[i] = (site << 32) | *const_cast<volatile uint32_t*>(&d_word);
}

ffi::Error Prepare(ffi::RunId run, ffi::RemainingArgs, ffi::RemainingRets, int64_t site) {
  Add(1, nullptr, run.run_id, site);
  return ffi::Error::Success();
}

ffi::Error Initialize(cudaStream_t s, ffi::RunId run, ffi::RemainingArgs, ffi::RemainingRets, int64_t site) {
  Add(2, s, run.run_id, site);
  SetWord<<<1, 1, 0, s>>>(static_cast<uint32_t>(run.run_id));  // in stream order, as a plan kernel would
  if (cudaGetLastError() != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, "probe: initialize could not write its word");
  return ffi::Error::Success();
}

ffi::Error Execute(cudaStream_t s, ffi::RunId run, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t site) {
  Add(3, s, run.run_id, site);
  if (cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, s) != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, "probe: copy");
  ReadWord<<<1, 1, 0, s>>>(static_cast<uint64_t>(site));
  return cudaGetLastError() == cudaSuccess ? ffi::Error::Success() : ffi::Error(ffi::ErrorCode::kInternal, "probe: kernel");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbePrepare, Prepare,
                              ffi::Ffi::BindPrepare().Ctx<ffi::RunId>().RemainingArgs().RemainingRets().Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeInitialize, Initialize,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::RunId>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("site"),
                              {ffi::Traits::kCmdBufferCompatible});

// For run.py (ctypes): the host records, then the device log.
extern "C" int64_t probe_records(void* out_v, int64_t cap) {
  Rec* out = static_cast<Rec*>(out_v);
  std::lock_guard lk(mu);
  const int64_t n = static_cast<int64_t>(recs.size());
  for (int64_t i = 0; i < n && i < cap; ++i) out[i] = recs[i];
  return n;
}
extern "C" int64_t probe_log(uint64_t* out, int64_t cap) {
  unsigned long long n = 0;
  if (cudaDeviceSynchronize() != cudaSuccess || cudaMemcpyFromSymbol(&n, d_n, sizeof(n)) != cudaSuccess) return -1;
  const int64_t m = static_cast<int64_t>(n < static_cast<unsigned long long>(kLog) ? n : kLog);
  if (cudaMemcpyFromSymbol(out, d_log, sizeof(uint64_t) * static_cast<size_t>(m < cap ? m : cap)) != cudaSuccess) return -1;
  return static_cast<int64_t>(n);
}
