// dfccl::Error out of any extension module's function, one rule for all of them
// (nanobind's translators are process-wide, so modules must agree): ValueError
// for an invalid value (ErrorCode::kInvalidArgument), else RuntimeError.
#pragma once

#include <nanobind/nanobind.h>

#include <exception>

#include "dfccl/check.h"

namespace dfccl {

inline void RegisterErrorTranslator() {
  nanobind::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const dfccl::Error& e) {
      PyErr_SetString(e.code() == dfccl::ErrorCode::kInvalidArgument ? PyExc_ValueError : PyExc_RuntimeError, e.what());
    }
  });
}

}  // namespace dfccl
