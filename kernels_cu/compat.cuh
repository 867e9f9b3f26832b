// Portability layer: kernel sources use only what this header offers, so the same text compiles
// under NVRTC (real CUDA) and as host C++20 for the CPU emulator (emu/runtime.h).
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#define PAGED_DEVICE __device__ __forceinline__
#define PAGED_HD __host__ __device__

namespace paged {
// One definition for the whole translation unit: every kernel reinterprets the same dynamic
// shared memory, as CUDA requires a single extern __shared__ array per kernel.
PAGED_DEVICE char* dynamic_smem() {
  extern __shared__ __align__(16) char paged_dynamic_smem[];
  return paged_dynamic_smem;
}
}  // namespace paged

#else

#include "emu/runtime.h"

#define PAGED_DEVICE inline
#define PAGED_HD

namespace paged {
inline char* dynamic_smem() { return paged_emu::dynamic_smem(); }
}  // namespace paged

#endif

namespace paged {
typedef long long int64;
constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr float FLT_MAX_ = 3.402823466e+38f;

PAGED_DEVICE float negative_infinity() {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
  return __int_as_float(0xff800000);
#else
  return -INFINITY;
#endif
}

PAGED_HD constexpr int div_up(int a, int b) { return (a + b - 1) / b; }
PAGED_HD constexpr int cmax(int a, int b) { return a > b ? a : b; }
PAGED_HD constexpr int cmin(int a, int b) { return a < b ? a : b; }

PAGED_DEVICE float to_float(float v) { return v; }
PAGED_DEVICE float to_float(__half v) { return __half2float(v); }
PAGED_DEVICE float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
PAGED_DEVICE float to_float(__nv_fp8_e4m3 v) { return static_cast<float>(v); }
PAGED_DEVICE float to_float(__nv_fp8_e5m2 v) { return static_cast<float>(v); }

// The largest finite value of each fp8 format.
template <typename T>
struct Fp8Max;
template <>
struct Fp8Max<__nv_fp8_e4m3> {
  static constexpr float value = 448.f;
};
template <>
struct Fp8Max<__nv_fp8_e5m2> {
  static constexpr float value = 57344.f;
};

template <typename T>
struct Convert;
template <>
struct Convert<float> {
  static PAGED_DEVICE float from(float v) { return v; }
};
template <>
struct Convert<__half> {
  static PAGED_DEVICE __half from(float v) { return __float2half_rn(v); }
};
template <>
struct Convert<__nv_bfloat16> {
  static PAGED_DEVICE __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};

// fp8 conversions round to nearest even and saturate to the finite range (__NV_SATFINITE).
template <>
struct Convert<__nv_fp8_e4m3> {
  static PAGED_DEVICE __nv_fp8_e4m3 from(float v) { return __nv_fp8_e4m3(v); }
};
template <>
struct Convert<__nv_fp8_e5m2> {
  static PAGED_DEVICE __nv_fp8_e5m2 from(float v) { return __nv_fp8_e5m2(v); }
};

template <typename T>
PAGED_DEVICE T from_float(float v) {
  return Convert<T>::from(v);
}
}  // namespace paged
