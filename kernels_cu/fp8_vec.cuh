// fp8 cache elements converted four at a time, as the decode kernels read them.
//
// A 32-bit word of four e4m3 or e5m2 values becomes two half2 words with integer operations only
// (a byte permute, a mask and a shift): each byte is moved to the top of a 16-bit half and its
// exponent and mantissa bits shifted into fp16's fields. e5m2 is fp16's upper byte, so it is
// exact as it stands; e4m3 lands with fp16's exponent bias (15) in place of its own (7), i.e.
// scaled by 2^-8, subnormals included. The kernels fold the 2^8 back into the KV head's scale
// (`Fp8Raw::scale`), so no conversion instruction runs per element.
//
// Both 16-bit model dtypes go through half: a bf16 target would need a 2^120 factor for e4m3,
// which overflows fp32 once multiplied with a scale over ~30, while every fp8 value is exact in
// half.
#pragma once

#include "vec.cuh"

namespace paged {

PAGED_DEVICE unsigned byte_perm(unsigned x, unsigned y, unsigned selector) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
  return __byte_perm(x, y, selector);
#else
  const unsigned long long bytes = static_cast<unsigned long long>(y) << 32 | x;
  unsigned out = 0;
  for (int i = 0; i < 4; ++i) out |= static_cast<unsigned>(bytes >> ((selector >> (4 * i) & 7) * 8) & 0xff) << (8 * i);
  return out;
#endif
}

// The factor between an fp8 value and the half its bits are moved into.
template <typename C>
struct Fp8Raw;
template <>
struct Fp8Raw<__nv_fp8_e4m3> {
  static constexpr float scale = 256.f;
  // 16-bit lanes holding a byte in their top half -> half bits: the sign stays, the rest moves down
  static PAGED_DEVICE unsigned to_half_bits(unsigned top) { return (top & 0x7f007f00u) >> 1 | (top & 0x80008000u); }
};
template <>
struct Fp8Raw<__nv_fp8_e5m2> {
  static constexpr float scale = 1.f;
  static PAGED_DEVICE unsigned to_half_bits(unsigned top) { return top; }
};

// Four fp8 values (byte i = element i) -> two half2 words (elements 0, 1 and 2, 3), each scaled by
// 1 / Fp8Raw<C>::scale.
template <typename C>
PAGED_DEVICE void fp8x4_to_half2x2(unsigned word, unsigned (&halves)[2]) {
  halves[0] = Fp8Raw<C>::to_half_bits(byte_perm(word, 0u, 0x1404u));
  halves[1] = Fp8Raw<C>::to_half_bits(byte_perm(word, 0u, 0x3424u));
}

// N cache elements as floats: fp8 ones scaled by 1 / Fp8Raw<C>::scale (the caller's KV scale holds
// the factor), four at a time where N allows; other dtypes exactly.
template <typename C, int N>
PAGED_DEVICE void to_floats(const Vec<C, N>& v, float (&out)[N]) {
  if constexpr (sizeof(C) == 1) {
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(v.val);
    if constexpr (N % 4 == 0) {
#pragma unroll
      for (int i = 0; i < N; i += 4) {
        unsigned halves[2];
        fp8x4_to_half2x2<C>(*reinterpret_cast<const unsigned*>(bytes + i), halves);
        const __half* h = reinterpret_cast<const __half*>(halves);
#pragma unroll
        for (int e = 0; e < 4; ++e) out[i + e] = __half2float(h[e]);
      }
    } else {
      // One or two bytes (v1/v2's narrow key vectors): the same bit moves, a word at a time.
      unsigned word = 0;
#pragma unroll
      for (int i = 0; i < N; ++i) word |= static_cast<unsigned>(bytes[i]) << (8 * i);
      unsigned halves[2];
      fp8x4_to_half2x2<C>(word, halves);
      const __half* h = reinterpret_cast<const __half*>(halves);
#pragma unroll
      for (int e = 0; e < N; ++e) out[e] = __half2float(h[e]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = to_float(v.val[e]);
  }
}

// The factor a KV head's scale carries for the raw values `to_floats` returns.
template <typename C>
PAGED_DEVICE constexpr float raw_scale() {
  if constexpr (sizeof(C) == 1) {
    return Fp8Raw<C>::scale;
  } else {
    return 1.f;
  }
}

}  // namespace paged
