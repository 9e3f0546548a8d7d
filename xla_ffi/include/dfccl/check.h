// The one error contract of every runtime (CPU, GPU, overlap).
//
// An error is a code and a message.  Runtime code throws dfccl::Error (with
// file and line); where an error must cross threads or wait for a later call
// (an asynchronous done on CPU, an error the GPU proxy recorded for the
// device's next handler call, a timeout a kernel recorded), it is kept as a
// dfccl::Status, the same code and message as a value.  The FFI boundary
// (xla_ffi/ffi/error.h, the one helper) turns either into an ffi::Error, so
// XLA raises it in Python; nothing else builds ffi::Errors.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace dfccl {

// What went wrong, as the caller can act on it (mapped 1:1 onto XLA's codes).
enum class ErrorCode : int32_t {
  kOk = 0,
  kInvalidArgument,     // a malformed call: attributes, shapes, dtypes, a device not in the group
  kFailedPrecondition,  // misuse: ranks disagree on a key's signature, a done without its start
  kDeadlineExceeded,    // a wait ran past its timeout (config.timeout_s, the fused overlap ops included)
  kResourceExhausted,   // too many collectives in flight
  kAborted,             // failed because another collective of the device or group failed first
  kInternal,            // a CUDA error, a broken invariant
};

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg, ErrorCode code = ErrorCode::kInternal)
      : std::runtime_error(msg), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

// An error kept as a value (or success).
struct Status {
  ErrorCode code = ErrorCode::kOk;
  std::string message;
  bool ok() const { return code == ErrorCode::kOk; }
  static Status Of(const Error& e) { return {e.code(), e.what()}; }
  [[noreturn]] void Throw() const { throw Error(message, code); }
};

namespace detail {
[[noreturn]] inline void Throw(const char* file, int line, const std::string& msg, ErrorCode code) {
  std::ostringstream os;
  os << msg << " [" << file << ":" << line << "]";
  throw Error(os.str(), code);
}
}  // namespace detail

}  // namespace dfccl

// DFCCL_CHECK_CODE(cond, code, "message " << value): throws dfccl::Error(code) with file/line.
#define DFCCL_CHECK_CODE(cond, code, msg)                                          \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::ostringstream dfccl_check_os_;                                          \
      dfccl_check_os_ << msg;                                                      \
      ::dfccl::detail::Throw(__FILE__, __LINE__, dfccl_check_os_.str(), (code));   \
    }                                                                              \
  } while (0)

// DFCCL_CHECK(cond, "message " << value): a malformed call (kInvalidArgument) unless
// the code says otherwise; DFCCL_CHECK_CUDA below is kInternal.
#define DFCCL_CHECK(cond, msg) DFCCL_CHECK_CODE(cond, ::dfccl::ErrorCode::kInvalidArgument, msg)

#define DFCCL_FAIL(msg) DFCCL_CHECK(false, msg)

// DFCCL_CHECK_CUDA(call, "where"): in CUDA code, throws "where: call: <CUDA error>"
// (kInternal) unless `call` returns cudaSuccess.  Each layer names it once (DFCCL_CUDA, OV_CUDA, ...).
#define DFCCL_CHECK_CUDA(call, where)                                                          \
  do {                                                                                         \
    const cudaError_t dfccl_cuda_err_ = (call);                                                \
    DFCCL_CHECK_CODE(dfccl_cuda_err_ == cudaSuccess, ::dfccl::ErrorCode::kInternal,            \
                     where ": " #call ": " << cudaGetErrorString(dfccl_cuda_err_));            \
  } while (0)
