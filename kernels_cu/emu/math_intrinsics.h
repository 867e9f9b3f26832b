// The CUDA math intrinsics kernels_cu/layer_ops.cuh uses, on the host: IEEE single-precision
// operations rounded to nearest even, never fused with a neighbour. A product is the only operand
// a compiler could fuse (into an FMA with the sum it feeds: GCC contracts across inlined calls in
// C++ on any target with FMA instructions), so it leaves through a volatile, which rounds it to
// float where it stands. expf is the host's libm (runtime.h includes math.h); CUDA's own expf
// differs from it by up to 2 ulp.
#pragma once

inline float __fmul_rn(float a, float b) {
  volatile float product = a * b;
  return product;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
