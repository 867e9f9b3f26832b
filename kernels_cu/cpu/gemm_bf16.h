// A bf16 linear layer on AVX512-BF16 (paged/kernels/bf16_linear.py says when it runs).
//
// y[m][o] = bf16(sum_k x[m][k] * w[o][k]): bf16 operands, fp32 sums (vdpbf16ps: a pair of k per
// instruction, denormals flushed), one rounding to bf16 at the end, as a bf16 GEMM does. With a
// few rows the layer is bound by streaming its weights, and the cost that matters is the rest:
// oneDNN's small-M bf16 path reached ~11 GB/s of weights at one row with two threads that sleep
// between calls (OMP_WAIT_POLICY=PASSIVE, paged's default beside neighbours: each call wakes
// them), against ~19 GB/s for this loop on one core, so a few rows run on the calling thread. With
// many rows (prefill) the tiles of 4 rows x 64 outputs keep 16 sums in registers and reach
// oneDNN's AVX512-BF16 speed (~400 GFLOP/s on two cores).
//
// The weight is packed once ([out/16][in/2][16][2]: for each block of 16 outputs, the pairs of
// consecutive inputs of every output side by side), so one 64-byte load feeds 16 outputs with two
// inputs each, and each block is read once per MR rows.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace paged_cpu {
namespace gemm {

constexpr int LANES = 16;  // outputs per register
constexpr int BLOCKS = 4;  // output blocks a tile keeps in registers
constexpr int MAX_TILE_ROWS = 4;

#if defined(__AVX512BF16__)
constexpr bool SUPPORTED = true;

inline void pack(const uint16_t *w, int64_t out_features, int64_t in_features, uint16_t *packed) {
  const int64_t pairs = in_features / 2;
  for (int64_t block = 0; block < out_features / LANES; ++block)
    for (int64_t p = 0; p < pairs; ++p)
      for (int lane = 0; lane < LANES; ++lane) {
        const uint16_t *src = w + (block * LANES + lane) * in_features + 2 * p;
        uint16_t *dst = packed + ((block * pairs + p) * LANES + lane) * 2;
        dst[0] = src[0];
        dst[1] = src[1];
      }
}

// MR rows of x against BLOCKS blocks of 16 outputs starting at `block`.
template <int MR>
inline void tile(uint16_t *y, int64_t y_stride, const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                 int64_t pairs, int64_t block) {
  __m512 acc[MR][BLOCKS];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < BLOCKS; ++b) acc[m][b] = _mm512_setzero_ps();
  const uint16_t *w = packed + block * pairs * LANES * 2;
  const int64_t block_elems = pairs * LANES * 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[BLOCKS];
    for (int b = 0; b < BLOCKS; ++b)
      wv[b] = (__m512bh)_mm512_loadu_si512(w + b * block_elems + p * LANES * 2);
    for (int m = 0; m < MR; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * x_stride + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int b = 0; b < BLOCKS; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], wv[b], xv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < BLOCKS; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(y + m * y_stride + (block + b) * LANES),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][b]));
}

// Every row against the blocks of output group `group` (BLOCKS blocks of 16 outputs): the group's
// weights come from memory once and from the cache for each further MAX_TILE_ROWS rows.
inline void group_rows(uint16_t *y, int64_t y_stride, const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                       int64_t num_rows, int64_t pairs, int64_t group) {
  const int64_t block = group * BLOCKS;
  for (int64_t m = 0; m < num_rows; m += MAX_TILE_ROWS) {
    const int64_t left = num_rows - m;
    uint16_t *y_m = y + m * y_stride;
    const uint16_t *x_m = x + m * x_stride;
    if (left >= 4) tile<4>(y_m, y_stride, x_m, x_stride, packed, pairs, block);
    else if (left == 3) tile<3>(y_m, y_stride, x_m, x_stride, packed, pairs, block);
    else if (left == 2) tile<2>(y_m, y_stride, x_m, x_stride, packed, pairs, block);
    else tile<1>(y_m, y_stride, x_m, x_stride, packed, pairs, block);
  }
}

// The layer over `num_threads` threads, output groups split evenly (1: on the calling thread).
inline void linear(uint16_t *y, int64_t y_stride, const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                   int64_t num_rows, int64_t out_features, int64_t in_features, int num_threads) {
  const int64_t pairs = in_features / 2, groups = out_features / (LANES * BLOCKS);
  if (num_threads > 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < groups; ++g) group_rows(y, y_stride, x, x_stride, packed, num_rows, pairs, g);
  } else {
    for (int64_t g = 0; g < groups; ++g) group_rows(y, y_stride, x, x_stride, packed, num_rows, pairs, g);
  }
}
#else
constexpr bool SUPPORTED = false;
#endif

}  // namespace gemm
}  // namespace paged_cpu
