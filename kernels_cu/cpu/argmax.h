// Greedy sampling's argmax over fp32 logits rows, as torch.argmax(dim=-1) returns it: the first
// index of the largest value, or of the first NaN in a row that holds one (torch takes NaN as the
// largest). torch's CPU argmax reads a decode step's logits (rows x a vocabulary of ~50K) at
// ~9 GB/s (0.7 ms for 32 rows of SmolLM2's); here, on AVX-512, each row is two vectorised passes
// over data the lm_head just wrote: its largest value (and whether it holds a NaN), then the first
// lane holding it. Elsewhere one scalar pass.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "layer_ops.h"  // kParallelGrain

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace paged_cpu {

#if defined(__AVX512F__)
inline int64_t argmax_row(const float* x, int64_t n) {
  // four chains of maxima (the max's latency), NaN lanes noted beside them
  __m512 m[4];
  for (__m512& v : m) v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int k = 0; k < 4; ++k) {
      const __m512 v = _mm512_loadu_ps(x + i + 16 * k);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      m[k] = _mm512_max_ps(m[k], v);
    }
  for (; i < n; i += 16) {
    const __mmask16 in = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(in, x + i);
    nan |= _mm512_mask_cmp_ps_mask(in, v, v, _CMP_UNORD_Q);
    m[0] = _mm512_mask_max_ps(m[0], in, m[0], v);
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (x[j] != x[j]) return j;
  }
  const __m512 top = _mm512_set1_ps(
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]))));
  for (int64_t j = 0; j < n; j += 16) {  // the first lane equal to the largest value (-0 == +0, as torch's)
    const __mmask16 in = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, x + j), top, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
  return 0;  // every value -inf: the first
}
#else
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t at = 0;
  for (int64_t i = 1; i < n; ++i)  // a NaN is taken over anything, and then nothing passes it
    if (x[i] > x[at] || (x[i] != x[i] && x[at] == x[at])) at = i;
  return at;
}
#endif

// out[t] = argmax_row(x + t * x_stride, cols) for each row; rows over the threads from
// kParallelGrain elements on (layer_ops.h), on the calling thread below.
inline void argmax_rows(int64_t* out, const float* x, int64_t x_stride, int64_t rows, int64_t cols,
                        int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= layer::kParallelGrain)
  for (int64_t t = 0; t < rows; ++t) out[t] = argmax_row(x + t * x_stride, cols);
}

}  // namespace paged_cpu
