// Error handling shared by every layer.
//
// Runtime code throws dfccl::Error (with file and line); the FFI boundary
// (xla_ffi/ffi/) converts it to an ffi::Error so that XLA raises it in Python.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dfccl {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] inline void Throw(const char* file, int line, const std::string& msg) {
  std::ostringstream os;
  os << msg << " [" << file << ":" << line << "]";
  throw Error(os.str());
}
}  // namespace detail

}  // namespace dfccl

// DFCCL_CHECK(cond, "message " << value): throws dfccl::Error with file/line.
#define DFCCL_CHECK(cond, msg)                                        \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::ostringstream dfccl_check_os_;                             \
      dfccl_check_os_ << msg;                                         \
      ::dfccl::detail::Throw(__FILE__, __LINE__, dfccl_check_os_.str()); \
    }                                                                 \
  } while (0)

#define DFCCL_FAIL(msg) DFCCL_CHECK(false, msg)

// DFCCL_CHECK_CUDA(call, "where"): in CUDA code, throws "where: call: <CUDA error>"
// unless `call` returns cudaSuccess.  Each layer names it once (DFCCL_CUDA, OV_CUDA, ...).
#define DFCCL_CHECK_CUDA(call, where)                                                          \
  do {                                                                                         \
    const cudaError_t dfccl_cuda_err_ = (call);                                                \
    DFCCL_CHECK(dfccl_cuda_err_ == cudaSuccess, where ": " #call ": " << cudaGetErrorString(dfccl_cuda_err_)); \
  } while (0)
