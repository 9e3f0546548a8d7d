// The FFI boundary's one error conversion (the contract is in dfccl/check.h):
// a dfccl::Status or a thrown dfccl::Error becomes an ffi::Error with the same
// code and message; any other exception is kInternal.  Every handler of every
// backend (ffi/cpu_handlers.cc, ffi/cuda_handlers.cc, ffi/overlap_handlers.cc)
// returns through FfiStatus / FfiGuard.
#pragma once

#include <exception>
#include <string>

#include "dfccl/check.h"
#include "xla/ffi/api/ffi.h"

namespace dfccl {

inline xla::ffi::Error FfiStatus(const Status& s) {
  namespace ffi = xla::ffi;
  switch (s.code) {
    case ErrorCode::kOk: return ffi::Error::Success();
    case ErrorCode::kInvalidArgument: return ffi::Error(ffi::ErrorCode::kInvalidArgument, s.message);
    case ErrorCode::kFailedPrecondition: return ffi::Error(ffi::ErrorCode::kFailedPrecondition, s.message);
    case ErrorCode::kDeadlineExceeded: return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, s.message);
    case ErrorCode::kResourceExhausted: return ffi::Error(ffi::ErrorCode::kResourceExhausted, s.message);
    case ErrorCode::kAborted: return ffi::Error(ffi::ErrorCode::kAborted, s.message);
    case ErrorCode::kInternal: break;
  }
  return ffi::Error(ffi::ErrorCode::kInternal, s.message);
}

// Runs body() (which returns nothing or throws) and converts what it throws.
template <class F>
xla::ffi::Error FfiGuard(F&& body) {
  try {
    body();
    return xla::ffi::Error::Success();
  } catch (const Error& e) {
    return FfiStatus(Status::Of(e));
  } catch (const std::exception& e) {
    return FfiStatus({ErrorCode::kInternal, std::string("dfccl: ") + e.what()});
  }
}

}  // namespace dfccl
