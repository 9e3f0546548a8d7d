// The one place element types are dispatched.  Kernels (host or device) are
// templates over the element type; DispatchDType calls f.template operator()<T>()
// with T the C++ type for a DType.  The 16-bit float types are supplied by the
// caller (host code uses dfccl::half_t/bfloat16_t below, CUDA code __half and
// __nv_bfloat16) through the Types parameter.
#pragma once

#include <cstdint>
#include <cstring>

#include "dfccl/check.h"
#include "dfccl/collective.h"

namespace dfccl {

#if defined(__CUDACC__)
#define DFCCL_HD __host__ __device__ __forceinline__
#else
#define DFCCL_HD inline
#endif

// Host 16-bit float storage types with float conversion (round to nearest even).
struct bfloat16_t {
  uint16_t bits;
  DFCCL_HD float to_float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static DFCCL_HD bfloat16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16_t{static_cast<uint16_t>((u >> 16) | 0x40)};  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return bfloat16_t{static_cast<uint16_t>(u >> 16)};
  }
};

struct half_t {
  uint16_t bits;
  DFCCL_HD float to_float() const {
    uint32_t sign = (bits & 0x8000u) << 16, exp = (bits >> 10) & 0x1f, man = bits & 0x3ffu, u;
    if (exp == 0) {
      if (man == 0) {
        u = sign;
      } else {  // subnormal
        int e = -1;
        do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
        u = sign | ((112 - e) << 23) | ((man & 0x3ffu) << 13);
      }
    } else if (exp == 31) {
      u = sign | 0x7f800000u | (man << 13);
    } else {
      u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static DFCCL_HD half_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u) return half_t{static_cast<uint16_t>(sign | 0x7e00u)};
    if (absu >= 0x47800000u) {  // overflow (incl. values rounding to inf)
      // values in [65520, inf) round to inf
      return half_t{static_cast<uint16_t>(sign | 0x7c00u)};
    }
    if (absu < 0x38800000u) {  // subnormal or zero in half
      if (absu < 0x33000000u) return half_t{static_cast<uint16_t>(sign)};
      uint32_t man = (absu & 0x7fffffu) | 0x800000u;
      int shift = 126 - static_cast<int>(absu >> 23);  // 14..24
      uint32_t res = man >> shift;
      uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
      if (rem > half || (rem == half && (res & 1u))) ++res;
      return half_t{static_cast<uint16_t>(sign | res)};
    }
    uint32_t res = ((absu >> 13) - (112u << 10));
    uint32_t rem = absu & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (res & 1u))) ++res;
    return half_t{static_cast<uint16_t>(sign | res)};
  }
};

inline int64_t DTypeBytes(DType t) {
  switch (t) {
#define DFCCL_X(E, id, name, bytes, CType) case DType::E: return bytes;
    DFCCL_DTYPE_TABLE(DFCCL_X)
#undef DFCCL_X
  }
  return 0;
}

inline bool IsSupportedDType(int32_t raw) {
  switch (static_cast<DType>(raw)) {
#define DFCCL_X(E, id, name, bytes, CType) case DType::E: return true;
    DFCCL_DTYPE_TABLE(DFCCL_X)
#undef DFCCL_X
  }
  return false;
}

inline const char* DTypeName(DType t) {
  switch (t) {
#define DFCCL_X(E, id, name, bytes, CType) case DType::E: return name;
    DFCCL_DTYPE_TABLE(DFCCL_X)
#undef DFCCL_X
  }
  return "?";
}

// Host-side type set; a CUDA caller passes its own with __half/__nv_bfloat16.
struct HostTypes {
  using f16 = half_t;
  using bf16 = bfloat16_t;
};

// Host and device (the CUDA daemon dispatches with it too; on the device an
// unsupported type traps instead of throwing).
template <typename Types = HostTypes, typename F>
DFCCL_HD decltype(auto) DispatchDType(DType t, F&& f) {
  switch (t) {
#define DFCCL_X(E, id, name, bytes, CType) case DType::E: return f.template operator()<CType>();
    DFCCL_DTYPE_TABLE(DFCCL_X)
#undef DFCCL_X
  }
#if defined(__CUDA_ARCH__)
  __trap();
  return f.template operator()<int32_t>();
#else
  DFCCL_FAIL("dfccl: unsupported element type " << static_cast<int>(t));
#endif
}

}  // namespace dfccl
