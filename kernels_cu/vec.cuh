// Vector loads and block-wide reductions shared by the kernels.
#pragma once

#include "compat.cuh"

namespace paged {

template <int BYTES>
struct Words;
template <>
struct Words<1> {
  typedef unsigned char type;
};
template <>
struct Words<2> {
  typedef unsigned short type;
};
template <>
struct Words<4> {
  typedef unsigned type;
};
template <>
struct Words<8> {
  typedef uint2 type;
};
template <>
struct Words<16> {
  typedef uint4 type;
};

template <typename T, int N>
struct __align__(sizeof(T) * N) Vec {
  T val[N];
};

// Going through a word type of the vector's width makes the device load one instruction
// (a 16-byte vector is a single ld.global.v4).
template <typename T, int N>
PAGED_DEVICE Vec<T, N> load_vec(const T* ptr) {
  typedef typename Words<sizeof(T) * N>::type W;
  Vec<T, N> v;
  *reinterpret_cast<W*>(&v) = *reinterpret_cast<const W*>(ptr);
  return v;
}

struct MaxOp {
  PAGED_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  PAGED_DEVICE float operator()(float a, float b) const { return a + b; }
};

template <int MAX_MASK, typename Op>
PAGED_DEVICE float warp_reduce(float value, Op op) {
#pragma unroll
  for (int mask = MAX_MASK; mask >= 1; mask /= 2) {
    value = op(value, __shfl_xor_sync(FULL_MASK, value, mask));
  }
  return value;
}

// Reduces one value per thread over the block and returns the result to every thread.
// `red_smem` holds NUM_WARPS floats; two reductions in a row need disjoint buffers because a fast
// warp may start writing the second before a slow one has read the first.
template <int NUM_WARPS, typename Op>
PAGED_DEVICE float block_reduce(float* red_smem, float value, float identity, Op op) {
  const int warp = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  value = warp_reduce<WARP_SIZE / 2>(value, op);
  if (lane == 0) red_smem[warp] = value;
  __syncthreads();
  value = lane < NUM_WARPS ? red_smem[lane] : identity;
  value = warp_reduce<NUM_WARPS / 2>(value, op);
  return __shfl_sync(FULL_MASK, value, 0);
}

}  // namespace paged
