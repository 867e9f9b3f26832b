// One warp-wide tensor-core product, D += A·B with A 16x16 (row major), B 16x8 (column major) in
// fp16 or bf16 and D 16x8 in fp32: PTX `mma.sync.m16n8k16`, the instruction flash-attention's
// kernels are built on (sm_80 and newer). Each lane holds fragments in the PTX ISA's layout, with
// g = lane / 4 and t = lane % 4:
//   A: a[0] = (row g,     cols 2t, 2t+1), a[1] = (row g + 8, cols 2t, 2t+1),
//      a[2] = (row g,     cols 2t+8, 2t+9), a[3] = (row g + 8, cols 2t+8, 2t+9)   (two values each)
//   B: b[0] = (rows 2t, 2t+1, col g),       b[1] = (rows 2t+8, 2t+9, col g)
//   D: d[0], d[1] = (row g, cols 2t, 2t+1), d[2], d[3] = (row g + 8, cols 2t, 2t+1)
// so the D fragments of two adjacent 8-column tiles are the A fragment of a 16-column tile, which
// lets attention feed its probabilities to the P·V product without leaving registers.
// The emulator computes the same product from every lane's fragments (emu/warp_mma.h).
#pragma once

#include "compat.cuh"
#include "fp8_vec.cuh"

// The instruction exists from sm_80 on; older targets take the kernels' CUDA-core path.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define PAGED_HAS_MMA 0
#else
#define PAGED_HAS_MMA 1
#endif

namespace paged {

template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

// Two values packed into one 32-bit fragment register, the first in the low half.
template <typename T>
PAGED_DEVICE unsigned pack2(float lo, float hi) {
  const T low = from_float<T>(lo), high = from_float<T>(hi);
  return static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(&low)) |
         static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(&high)) << 16;
}

template <typename T>
PAGED_DEVICE unsigned load2(const T* ptr) {
  return *reinterpret_cast<const unsigned*>(ptr);
}

// A half2 register as a fragment register of T; exact for the raw fp8 values fp8_vec.cuh makes.
template <typename T>
PAGED_DEVICE unsigned half2_to(unsigned halves) {
  if constexpr (SameType<T, __half>::value) {
    return halves;
  } else {
    const __half* h = reinterpret_cast<const __half*>(&halves);
    return pack2<T>(__half2float(h[0]), __half2float(h[1]));
  }
}

// Two consecutive elements of a K/V tile as a fragment register of T (the first in the low half):
// T pairs as they are, fp8 converted in registers to raw values (scaled by 1 / Fp8Raw::scale, the
// KV scale carries the factor), exact in fp16 and bf16.
template <typename T, typename C>
PAGED_DEVICE unsigned fragment_pair(const C* src) {
  if constexpr (sizeof(C) == 1) {
    unsigned halves[2];
    fp8x4_to_half2x2<C>(*reinterpret_cast<const unsigned short*>(src), halves);
    return half2_to<T>(halves[0]);
  } else {
    return load2(src);
  }
}

template <typename T>
PAGED_DEVICE void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  static_assert(sizeof(T) == 2, "tensor-core fragments hold fp16 or bf16 pairs");
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#if PAGED_HAS_MMA
  if constexpr (SameType<T, __half>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
#else
  paged_emu::mma_16816<T>(d, a, b);
#endif
}

}  // namespace paged
