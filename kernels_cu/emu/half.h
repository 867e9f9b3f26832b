// Host stand-ins for CUDA's 16-bit float storage types: same size and bits as __half and
// __nv_bfloat16, converted through float with round-to-nearest-even like the device intrinsics.
#pragma once

#include <bit>
#include <cstdint>

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
