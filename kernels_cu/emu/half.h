// Host stand-ins for CUDA's 16-bit and 8-bit float storage types: same size and bits as __half,
// __nv_bfloat16, __nv_fp8_e4m3 and __nv_fp8_e5m2, converted through float with round-to-nearest-even
// like the device intrinsics (fp8 saturating to the finite range, as cuda_fp8.h's constructors do).
#pragma once

#include <bit>
#include <cstdint>

// The cpu backend's conversions, so both CPU implementations round fp8 the same way.
#include "../cpu/fp8.h"

struct __half {
  _Float16 value;
};

struct __nv_bfloat16 {
  std::uint16_t bits;
};

static_assert(sizeof(__half) == 2 && sizeof(__nv_bfloat16) == 2);

inline float __half2float(__half h) { return static_cast<float>(h.value); }
inline __half __float2half_rn(float f) { return __half{static_cast<_Float16>(f)}; }

inline float __bfloat162float(__nv_bfloat16 b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b.bits) << 16);
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return __nv_bfloat16{static_cast<std::uint16_t>((u >> 16) | 0x40u)};  // keep NaN a NaN
  }
  const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<std::uint16_t>(rounded >> 16)};
}

struct __nv_fp8_e4m3 {
  std::uint8_t __x;
  __nv_fp8_e4m3() = default;
  explicit __nv_fp8_e4m3(float f) : __x(paged_fp8::float_to_e4m3(f)) {}
  explicit operator float() const { return paged_fp8::e4m3_to_float(__x); }
};

struct __nv_fp8_e5m2 {
  std::uint8_t __x;
  __nv_fp8_e5m2() = default;
  explicit __nv_fp8_e5m2(float f) : __x(paged_fp8::float_to_e5m2(f)) {}
  explicit operator float() const { return paged_fp8::e5m2_to_float(__x); }
};

static_assert(sizeof(__nv_fp8_e4m3) == 1 && sizeof(__nv_fp8_e5m2) == 1);
