// Fused elementwise layer ops of the CPU model path (paged/kernels/layer_ops.py) and the native
// reshape_and_cache of backend "cpu": RMSNorm, residual add + RMSNorm, SiLU-and-mul, RoPE.
//
// Every op runs over rows (tokens) in parallel with OpenMP (static schedule, the caller's thread
// count; inputs smaller than kParallelGrain elements run on the calling thread), allocates
// nothing, and reproduces torch's fp32 arithmetic on the same CPU operation by operation, so the
// model's outputs stay bit-identical to its torch formulation:
//   - no FMA contraction anywhere in this file (the push_options region below): torch rounds every
//     elementwise product and sum separately (`x * cos + rot * sin`, `x * x` before summing);
//   - the RMSNorm sum of squares follows ATen's cascade_sum order for a contiguous inner reduction
//     (vectorized_inner_sum: 8-lane vector accumulators, 4 ILP rows, 4 cascade levels, the scalar
//     tail, then the lanes in order). 8 lanes: ATen's sum kernel has no AVX512 build, so AVX512
//     machines run its AVX2 one, and the DEFAULT build's Vectorized<float> has 8 lanes too. Then
//     mean = sum / H, + eps, 1 / sqrt, x * rstd, * weight, as `weight * F.rms_norm(x)` does;
//   - SiLU is x / (1 + exp(-x)) with exp as torch computes it: Sleef's expf_u10 (reproduced below,
//     with its fused multiply-adds) over the first floor(I / 2L) * 2L elements of a row, and libm's
//     expf over the rest, as ATen's vectorized_loop splits a row of L-lane vectors (silu does have
//     an AVX512 build: L = 16 there, 8 on AVX2); exp_lanes 0 means libm for every element (torch's
//     DEFAULT capability).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace paged_cpu {
namespace layer {

// Below this many elements an op runs on the calling thread: waking the pool costs more.
constexpr int64_t kParallelGrain = 16384;

// ---- RMSNorm -----------------------------------------------------------------------------------

// ATen's utils::CeilLog2.
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// sum(x[i] * x[i]) in the order of ATen's vectorized_inner_sum over L-lane vectors (L = 1: its
// scalar_inner_sum, used when the row is shorter than one vector).
template <int L>
inline float sum_squares(const float* x, int64_t n) {
  constexpr int kLevels = 4, kIlp = 4;
  const int64_t nvec = n / L, rows = nvec / kIlp;  // rows of kIlp vectors
  float acc[kLevels][kIlp][L];
  std::memset(acc, 0, sizeof acc);
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(rows) / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  auto add_row = [&](int64_t r) {
    const float* p = x + r * kIlp * L;
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < L; ++l) {
        const float v = p[k * L + l];
        acc[0][k][l] += v * v;
      }
  };
  int64_t i = 0;
  while (i + level_step <= rows) {
    for (int64_t j = 0; j < level_step; ++j, ++i) add_row(i);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < L; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.f;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = rows * kIlp; v < nvec; ++v)  // vectors left over from the ILP rows
    for (int l = 0; l < L; ++l) {
      const float e = x[v * L + l];
      acc[0][0][l] += e * e;
    }
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.f;
  for (int64_t e = nvec * L; e < n; ++e) total += x[e] * x[e];
  for (int l = 0; l < L; ++l) total += acc[0][0][l];
  return total;
}

constexpr int kSumLanes = 8;

inline float rstd_of(const float* x, int64_t n, float eps) {
  const float sum = n >= kSumLanes ? sum_squares<kSumLanes>(x, n) : sum_squares<1>(x, n);
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

inline void scale_row(float* out, const float* x, const float* w, int64_t n, float rstd) {
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * rstd) * w[i];
}

// out[t] = rms_norm(x[t]) * w; out may be x (each row is read before it is written).
inline void rms_norm(float* out, int64_t out_stride, const float* x, int64_t x_stride, const float* w, int64_t T,
              int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * H >= kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * x_stride;
    scale_row(out + t * out_stride, row, w, H, rstd_of(row, H, eps));
  }
}

// residual[t] += x[t]; x[t] = rms_norm(residual[t]) * w.
inline void add_rms_norm(float* x, int64_t x_stride, float* residual, int64_t r_stride, const float* w, int64_t T,
                  int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * H >= kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    float* xr = x + t * x_stride;
    float* rr = residual + t * r_stride;
    for (int64_t i = 0; i < H; ++i) rr[i] = rr[i] + xr[i];
    scale_row(xr, rr, w, H, rstd_of(rr, H, eps));
  }
}

// ---- SiLU and mul ------------------------------------------------------------------------------

// Sleef's xexpf (the u10 vector expf torch's Vectorized<float>::exp calls on AVX2 / AVX512), with
// its multiply-adds fused as they are there. Its range selects: 0 below -104, +inf above 100.
inline float sleef_expf(float d) {
  constexpr float kRLn2 = 1.442695040888963407359924681001892137426645954152985934135449406931f;
  constexpr float kL2U = 0.693145751953125f, kL2L = 1.428606765330187045e-06f;
  // q only matters inside the selects' range; clamping keeps the int conversion defined (NaN too).
  const float dc = d >= -105.f ? (d <= 105.f ? d : 105.f) : -105.f;
  const float qf = __builtin_rintf(dc * kRLn2);
  const int32_t q = static_cast<int32_t>(qf);
  float s = __builtin_fmaf(qf, -kL2U, d);
  s = __builtin_fmaf(qf, -kL2L, s);
  float u = static_cast<float>(0.000198527617612853646278381);
  u = __builtin_fmaf(u, s, static_cast<float>(0.00139304355252534151077271));
  u = __builtin_fmaf(u, s, static_cast<float>(0.00833336077630519866943359));
  u = __builtin_fmaf(u, s, static_cast<float>(0.0416664853692054748535156));
  u = __builtin_fmaf(u, s, static_cast<float>(0.166666671633720397949219));
  u = __builtin_fmaf(u, s, 0.5f);
  u = 1.f + __builtin_fmaf(s * s, u, s);
  const int32_t q1 = q >> 1, q2 = q - q1;  // ldexp in two steps, as Sleef's vldexp2
  u = u * __builtin_bit_cast(float, (q1 + 0x7f) << 23);
  u = u * __builtin_bit_cast(float, (q2 + 0x7f) << 23);
  if (d < -104.f) u = 0.f;
  if (100.f < d) u = __builtin_inff();
  return u;
}

// out[t] = silu(x[t, :I]) * x[t, I:], silu(g) = g / (1 + exp(-g)).
inline void silu_and_mul(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t T, int64_t I,
                         int exp_lanes, int num_threads) {
  const int64_t sleef_end = exp_lanes > 0 ? I / (2 * exp_lanes) * (2 * exp_lanes) : 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I >= kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    const float* g = x + t * x_stride;
    const float* u = g + I;
    float* o = out + t * out_stride;
    for (int64_t i = 0; i < sleef_end; ++i) o[i] = (g[i] / (1.f + sleef_expf(-g[i]))) * u[i];
    for (int64_t i = sleef_end; i < I; ++i) o[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
  }
}

// ---- RoPE --------------------------------------------------------------------------------------

// Rotates num_heads heads of head_dim at the start of each row of qk in place, HF's rotate_half
// layout (i pairs with i + head_dim / 2), as `x * cos + rotate_half(x) * sin` with cos / sin rows
// [head_dim] from tables [P, head_dim] at the token's position (checked in range by the caller).
inline void rotary_embedding(float* qk, int64_t row_stride, const int64_t* positions, const float* cos,
                             const float* sin, int64_t T, int num_heads, int head_dim, int num_threads) {
  const int half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (T * num_heads * head_dim >= kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + positions[t] * head_dim;
    const float* s = sin + positions[t] * head_dim;
    for (int h = 0; h < num_heads; ++h) {
      float* x = qk + t * row_stride + static_cast<int64_t>(h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        // -(x2) * s == -(x2 * s) exactly, and a + -b == a - b.
        const float a = x1 * c[i], b = x2 * s[i];
        const float e = x2 * c[i + half], f = x1 * s[i + half];
        x[i] = a - b;
        x[i + half] = e + f;
      }
    }
  }
}

// ---- reshape_and_cache -------------------------------------------------------------------------

// key / value [T, kv_heads, head_size] with any element strides, into the caches (layouts in
// common.h) of the same element type E (a 2- or 4-byte bit pattern: the copy is exact). Slots < 0
// are skipped; the caller checked every other slot is < num_blocks * block_size.
template <typename E>
void reshape_and_cache(const E* key, const int64_t* ks, const E* value, const int64_t* vs, E* key_cache,
                       E* value_cache, const int64_t* slots, int64_t T, int kv_heads, int head_size,
                       int block_size, int num_threads) {
  constexpr int x = 16 / sizeof(E);
  const int chunks = head_size / x;
  const int64_t tile = static_cast<int64_t>(head_size) * block_size;  // one (block, head) tile
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (T * kv_heads * head_size >= kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int h = 0; h < kv_heads; ++h) {
      const E* k = key + t * ks[0] + h * ks[1];
      const E* v = value + t * vs[0] + h * vs[1];
      E* kd = key_cache + (block * kv_heads + h) * tile + offset * x;
      E* vd = value_cache + (block * kv_heads + h) * tile + offset;
      if (ks[2] == 1) {
        for (int c = 0; c < chunks; ++c) std::memcpy(kd + c * block_size * x, k + c * x, sizeof(E) * x);
      } else {
        for (int c = 0; c < chunks; ++c)
          for (int j = 0; j < x; ++j) kd[c * block_size * x + j] = k[(c * x + j) * ks[2]];
      }
      for (int d = 0; d < head_size; ++d) vd[static_cast<int64_t>(d) * block_size] = v[d * vs[2]];
    }
  }
}

}  // namespace layer
}  // namespace paged_cpu

#pragma GCC pop_options
