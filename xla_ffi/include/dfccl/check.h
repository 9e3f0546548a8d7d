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
