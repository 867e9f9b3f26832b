// fp8 <-> fp32 conversions of the KV cache formats (paged/kernels/features.py): e4m3fn (bias 7,
// no infinities, NaN = S.1111.111, largest 448) and e5m2 (bias 15, IEEE-like, largest 57344).
//
// Plain C++17 with no dependencies: the cpu backend and the CUDA emulator's host build both
// include it. Decoding is exact; encoding rounds to nearest even like torch's `.to(float8_*)`,
// but saturates to the largest finite value (as CUDA's __NV_SATFINITE conversion does) where
// torch overflows to NaN / inf, which the callers' clamp makes unreachable. NaN encodes as 0x7f
// (a NaN in both formats). Decoding is integer arithmetic and selections, so a loop over a block
// vectorises; neither direction ever computes on a subnormal float (slow on x86).
#pragma once

#include <cstdint>
#include <cstring>

namespace paged_fp8 {

inline float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// Magnitude code `em` (the 7 bits below the sign) of a format with `kMan` mantissa bits and
// exponent bias `kBias` -> fp32 bits: a normal value moves its fields into place and rebiases
// the exponent; a subnormal is em units of 2^(1 - kBias - kMan), exact in fp32.
template <int kMan, int kBias>
inline uint32_t magnitude_bits(uint32_t em) {
  const uint32_t normal = (em << (23 - kMan)) + (static_cast<uint32_t>(127 - kBias) << 23);
  const float unit = from_bits(static_cast<uint32_t>(128 - kBias - kMan) << 23);
  const uint32_t subnormal = to_bits(static_cast<float>(em) * unit);
  return em >> kMan ? normal : subnormal;
}

inline float e4m3_to_float(uint8_t v) {
  const uint32_t em = v & 0x7fu;
  const uint32_t magnitude = em == 0x7fu ? 0x7fc00000u : magnitude_bits<3, 7>(em);
  return from_bits(static_cast<uint32_t>(v & 0x80u) << 24 | magnitude);
}

inline float e5m2_to_float(uint8_t v) {
  const uint32_t em = v & 0x7fu;
  // Exponent 31: infinity with a zero mantissa, NaN otherwise.
  const uint32_t magnitude = em >= 0x7cu ? 0x7f800000u | (em & 3u) << 21 : magnitude_bits<2, 15>(em);
  return from_bits(static_cast<uint32_t>(v & 0x80u) << 24 | magnitude);
}

// Round-to-nearest-even fp32 -> fp8 of a format with `kMan` mantissa bits, exponent bias `kBias`
// and largest finite magnitude code `kMaxCode`.
template <int kMan, int kBias, uint32_t kMaxCode>
inline uint8_t float_to_fp8(float f) {
  const uint32_t bits = to_bits(f);
  const uint8_t sign = static_cast<uint8_t>(bits >> 24 & 0x80u);
  const uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;
  const uint32_t e = a >> 23;  // the fp32 biased exponent
  uint32_t code;
  if (e > static_cast<uint32_t>(127 - kBias)) {
    // A normal fp8: round away the low 23 - kMan mantissa bits (a carry bumps the exponent, which
    // is what rounding up to the next binade means), then rebias. Past the largest finite value
    // (infinity included) it saturates.
    constexpr int kDrop = 23 - kMan;
    const uint32_t rounded = a + ((1u << (kDrop - 1)) - 1) + (a >> kDrop & 1u);
    code = (rounded >> kDrop) - (static_cast<uint32_t>(127 - kBias) << kMan);
    if (code > kMaxCode) code = kMaxCode;
  } else {
    // A subnormal fp8 (or zero): the value in units of 2^(1 - kBias - kMan), rounded. The
    // significand m has its implicit bit unless the fp32 is subnormal itself (exponent field 0
    // meaning 1), and the value is m * 2^(e - 150), so units = m >> (151 - kBias - kMan - e).
    const uint32_t m = e ? (a & 0x7fffffu) | 0x800000u : a;
    const uint32_t shift = static_cast<uint32_t>(151 - kBias - kMan) - (e ? e : 1);
    if (shift > 24) return sign;  // below half the smallest subnormal: m < 2^24 <= the half unit
    const uint32_t half = 1u << (shift - 1), rest = m & ((half << 1) - 1);
    code = m >> shift;
    code += rest > half || (rest == half && (code & 1u));
  }
  return static_cast<uint8_t>(sign | code);
}

inline uint8_t float_to_e4m3(float f) { return float_to_fp8<3, 7, 0x7e>(f); }
inline uint8_t float_to_e5m2(float f) { return float_to_fp8<2, 15, 0x7b>(f); }

}  // namespace paged_fp8
