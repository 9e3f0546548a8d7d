// The op, reduce-op and dtype tables (dfccl/ops.h, dfccl/collective.h) as
// Python objects: both extension modules export them as `op_table()`, and
// jax_dfccl/_src/core.py takes its op ids from there (one source of truth).
#pragma once

#include <nanobind/nanobind.h>

#include "dfccl/collective.h"
#include "dfccl/dtype.h"

namespace dfccl::bindings {

inline nanobind::dict OpTable() {
  namespace nb = nanobind;
  static const char* kRules[] = {"same", "gather", "scatter", "exchange", "given"};
  nb::dict ops, reduces, dtypes;
  for (const OpInfo& o : kOps)
    ops[o.name] = nb::make_tuple(static_cast<int>(o.kind), o.reduces, kRules[static_cast<int>(o.rule)]);
  for (const ReduceInfo& r : kReduces) reduces[r.name] = static_cast<int>(r.op);
#define DFCCL_X(E, id, name, bytes, CType) dtypes[name] = nb::make_tuple(id, bytes);
  DFCCL_DTYPE_TABLE(DFCCL_X)
#undef DFCCL_X
  nb::dict d;
  d["ops"] = ops;
  d["reduces"] = reduces;
  d["dtypes"] = dtypes;
  return d;
}

}  // namespace dfccl::bindings
