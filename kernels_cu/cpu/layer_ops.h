// Fused elementwise layer ops of the CPU model path (paged/kernels/fused_ops.py) and the native
// reshape_and_cache of backend "cpu": RMSNorm, residual add + RMSNorm, SiLU-and-mul, RoPE.
//
// Every op runs over rows (tokens) in parallel with OpenMP (static schedule, the caller's thread
// count; inputs smaller than kParallelGrain elements run on the calling thread), allocates
// nothing once warm (the bf16 norms' row buffers grow to the widest row, then stay), and
// reproduces torch's fp32 arithmetic on the same CPU operation by operation, so the model's
// outputs stay bit-identical to its torch formulation:
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
//
// bf16 (a `model.dtype=bfloat16` model): the same ops on bf16 rows, computed in fp32 and rounded to
// bf16 (nearest even, as torch) wherever the torch formulas round in bf16, which is after every
// elementwise op, so they are bit-identical to those formulas too:
//   - RMSNorm is HF's `weight * F.rms_norm(x.float()).to(bf16)`: the fp32 norm above of the widened
//     row, rounded, then times the bf16 weight, rounded (a product of two bf16 values is exact in
//     fp32, so one rounding of it is torch's bf16 product); the residual add is the fp32 sum, rounded;
//   - SiLU-and-mul rounds silu(g) before the product. silu(g) in bf16 is a function of g's 16 bits:
//     a table of all 65536, filled once per process with Sleef's expf. Where torch takes libm's expf
//     (its scalar tail), the two can differ in fp32's last place but round to the same bf16 silu for
//     every bf16 input (tests/test_layer_ops_bf16.py checks all of them against F.silu);
//   - RoPE rounds x * cos and rotate_half(x) * sin, then their sum; the tables are bf16 too.
// The bf16 row kernels widen a row to fp32 (the norms: whole rows, into per-thread buffers; SiLU
// and RoPE: chunks on the stack), compute there, and narrow the result: loops over one element
// width, which the compiler vectorises well (mixed 16/32-bit loops it does not). The narrowing is
// integer round-to-nearest-even, not AVX512-BF16's VCVTNEPS2BF16: that instruction flushes fp32
// denormals to zero, torch's conversion keeps them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace paged_cpu {
namespace layer {

// Below this many elements an op runs on the calling thread: waking the pool costs more. Inside a
// model's forward a wake costs far more than in a loop of calls (the PASSIVE worker has slept through
// the matmul before): at 16384, the decode-sized calls that crossed it took 50-120 us against 11-14
// alone; at 2^17 a decode-heavy run (32 x 64-token prompts, 96 tokens out, SmolLM2, 2 threads, the
// AVX512-BF16 EPYC) took 9-10% less time in bf16 and fp32. Prefill rows (512+ x 576) stay parallel.
constexpr int64_t kParallelGrain = 1 << 17;

// ---- bf16 rows ---------------------------------------------------------------------------------

// common.h's float_to_bf16, in the high half of an fp32 pattern and without a branch (so it
// vectorises): round to nearest even, NaN kept quiet.
inline uint32_t bf16_rounded_bits(float f) {
  const uint32_t b = __builtin_bit_cast(uint32_t, f);
  const uint32_t nearest = b + 0x7fffu + ((b >> 16) & 1u);
  return (f != f ? b | 0x400000u : nearest) & 0xffff0000u;
}

// What a bf16 tensor keeps of an fp32 result, as fp32.
inline float round_bf16(float f) { return __builtin_bit_cast(float, bf16_rounded_bits(f)); }

// The bf16 row kernels work on rows in chunks of this many fp32 elements on the stack.
constexpr int64_t kChunk = 128;

inline void widen(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

inline void narrow(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<uint16_t>(bf16_rounded_bits(src[i]) >> 16);
}

// ---- RMSNorm -----------------------------------------------------------------------------------

// ATen's utils::CeilLog2.
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// sum(x[i] * x[i]) of the row as fp32, in the order of ATen's vectorized_inner_sum over L-lane
// vectors (L = 1: its scalar_inner_sum, used when the row is shorter than one vector).
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
  for (int64_t e = nvec * L; e < n; ++e) {
    const float v = x[e];
    total += v * v;
  }
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
inline void rms_norm(float* out, int64_t out_stride, const float* x, int64_t x_stride, const float* w, int64_t rows,
                     int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * H >= kParallelGrain)
  for (int64_t t = 0; t < rows; ++t) {
    const float* row = x + t * x_stride;
    scale_row(out + t * out_stride, row, w, H, rstd_of(row, H, eps));
  }
}

// residual[t] += x[t]; x[t] = rms_norm(residual[t]) * w.
inline void add_rms_norm(float* x, int64_t x_stride, float* residual, int64_t r_stride, const float* w, int64_t rows,
                         int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * H >= kParallelGrain)
  for (int64_t t = 0; t < rows; ++t) {
    float* xr = x + t * x_stride;
    float* rr = residual + t * r_stride;
    for (int64_t i = 0; i < H; ++i) rr[i] = rr[i] + xr[i];
    scale_row(xr, rr, w, H, rstd_of(rr, H, eps));
  }
}

// bf16 rows are widened to fp32 once, into per-thread buffers that grow with the widest row seen
// (so a call allocates nothing once warm): the sum of squares and the scaling then run on fp32
// rows, where they vectorise, instead of converting every element on each of the norm's three
// reads. Widening is exact, so the sums are those of the bf16 rows, in the same order.
enum RowBuffer { kRow, kRowIn, kWeight };
inline float* row_buffer(RowBuffer which, int64_t n) {
  thread_local std::vector<float> buffers[3];
  std::vector<float>& b = buffers[which];
  if (static_cast<int64_t>(b.size()) < n) b.resize(n);
  return b.data();
}

// HF's order in bf16: normalise the widened row xs in fp32, round, times the weight, round.
inline void scale_row(uint16_t* out, const float* xs, const float* ws, int64_t n, float rstd) {
  float* scaled = row_buffer(kRowIn, n);
  for (int64_t i = 0; i < n; ++i) scaled[i] = round_bf16(xs[i] * rstd) * ws[i];
  narrow(scaled, out, n);
}

inline void rms_norm(uint16_t* out, int64_t out_stride, const uint16_t* x, int64_t x_stride, const uint16_t* w,
                     int64_t rows, int64_t H, float eps, int num_threads) {
  float* ws = row_buffer(kWeight, H);  // the caller's; the team only reads it
  widen(w, ws, H);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * H >= kParallelGrain)
  for (int64_t t = 0; t < rows; ++t) {
    float* xs = row_buffer(kRow, H);
    widen(x + t * x_stride, xs, H);
    scale_row(out + t * out_stride, xs, ws, H, rstd_of(xs, H, eps));
  }
}

// The residual sum is rounded to bf16 (what the residual tensor keeps) before the norm reads it.
inline void add_rms_norm(uint16_t* x, int64_t x_stride, uint16_t* residual, int64_t r_stride, const uint16_t* w,
                         int64_t rows, int64_t H, float eps, int num_threads) {
  float* ws = row_buffer(kWeight, H);
  widen(w, ws, H);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * H >= kParallelGrain)
  for (int64_t t = 0; t < rows; ++t) {
    uint16_t* xr = x + t * x_stride;
    uint16_t* rr = residual + t * r_stride;
    float* rs = row_buffer(kRow, H);
    float* xs = row_buffer(kRowIn, H);
    widen(rr, rs, H);
    widen(xr, xs, H);
    for (int64_t i = 0; i < H; ++i) rs[i] = round_bf16(rs[i] + xs[i]);
    narrow(rs, rr, H);
    scale_row(xr, rs, ws, H, rstd_of(rs, H, eps));
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

// silu(g) rounded to bf16 for every bf16 g (its 16 bits index it), filled on first use (128 KiB,
// static: the ops allocate nothing per call); silu_and_mul takes it before its parallel loop.
inline const uint16_t* bf16_silu_table() {
  static const uint16_t* const table = [] {
    static uint16_t silu[1 << 16];
    for (uint32_t h = 0; h < (1u << 16); ++h) {
      const float g = bf16_to_float(static_cast<uint16_t>(h));
      silu[h] = static_cast<uint16_t>(bf16_rounded_bits(g / (1.f + sleef_expf(-g))) >> 16);
    }
    return silu;
  }();
  return table;
}

// bf16: out[t] = silu(x[t, :I]) * x[t, I:], the silu looked up (rounded), the product rounded.
inline void silu_and_mul(uint16_t* out, int64_t out_stride, const uint16_t* x, int64_t x_stride, int64_t T,
                         int64_t I, int num_threads) {
  const uint16_t* silu = bf16_silu_table();
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I >= kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* g = x + t * x_stride;
    const uint16_t* u = g + I;
    uint16_t* o = out + t * out_stride;
    float ss[kChunk], us[kChunk];
    for (int64_t c = 0; c < I; c += kChunk) {
      const int64_t m = std::min(kChunk, I - c);
      for (int64_t i = 0; i < m; ++i) ss[i] = bf16_to_float(silu[g[c + i]]);
      widen(u + c, us, m);
      for (int64_t i = 0; i < m; ++i) ss[i] = ss[i] * us[i];
      narrow(ss, o + c, m);
    }
  }
}

// ---- RoPE --------------------------------------------------------------------------------------

// The first num_heads heads of head_dim of one row, rotated in place by its cos / sin rows.
inline void rotate_heads(float* row, const float* c, const float* s, int num_heads, int head_dim) {
  const int half = head_dim / 2;
  for (int h = 0; h < num_heads; ++h) {
    float* x = row + static_cast<int64_t>(h) * head_dim;
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

// bf16: every product rounded, then the sum (the rounding of -(x2 * s) is minus that of x2 * s).
// The table rows are widened once per row for all its heads, a chunk of half at a time.
inline void rotate_heads(uint16_t* row, const uint16_t* c, const uint16_t* s, int num_heads, int head_dim) {
  const int64_t half = head_dim / 2;
  float c1[kChunk], c2[kChunk], s1[kChunk], s2[kChunk], x1[kChunk], x2[kChunk];
  for (int64_t k = 0; k < half; k += kChunk) {
    const int64_t m = std::min(kChunk, half - k);
    widen(c + k, c1, m);
    widen(c + half + k, c2, m);
    widen(s + k, s1, m);
    widen(s + half + k, s2, m);
    for (int h = 0; h < num_heads; ++h) {
      uint16_t* x = row + static_cast<int64_t>(h) * head_dim;
      widen(x + k, x1, m);
      widen(x + half + k, x2, m);
      for (int64_t i = 0; i < m; ++i) {
        const float a = round_bf16(x1[i] * c1[i]), b = round_bf16(x2[i] * s1[i]);
        const float e = round_bf16(x2[i] * c2[i]), f = round_bf16(x1[i] * s2[i]);
        x1[i] = a - b;
        x2[i] = e + f;
      }
      narrow(x1, x + k, m);
      narrow(x2, x + half + k, m);
    }
  }
}

// Rotates num_heads heads of head_dim at the start of each row of qk in place, HF's rotate_half
// layout (i pairs with i + head_dim / 2), as `x * cos + rotate_half(x) * sin` with cos / sin rows
// [head_dim] from tables [P, head_dim] at the token's position (checked in range by the caller).
template <typename T>
inline void rotary_embedding(T* qk, int64_t row_stride, const int64_t* positions, const T* cos, const T* sin,
                             int64_t rows, int num_heads, int head_dim, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * num_heads * head_dim >= kParallelGrain)
  for (int64_t t = 0; t < rows; ++t)
    rotate_heads(qk + t * row_stride, cos + positions[t] * head_dim, sin + positions[t] * head_dim, num_heads,
                 head_dim);
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
  for_each_cache_slot<x>(key_cache, value_cache, slots, T, kv_heads, head_size, block_size, num_threads,
                         [&](int64_t t, int h, E* kd, E* vd) {
    const E* k = key + t * ks[0] + h * ks[1];
    const E* v = value + t * vs[0] + h * vs[1];
    if (ks[2] == 1) {
      for (int c = 0; c < chunks; ++c) std::memcpy(kd + c * block_size * x, k + c * x, sizeof(E) * x);
    } else {
      for (int c = 0; c < chunks; ++c)
        for (int j = 0; j < x; ++j) kd[c * block_size * x + j] = k[(c * x + j) * ks[2]];
    }
    for (int d = 0; d < head_size; ++d) vd[static_cast<int64_t>(d) * block_size] = v[d * vs[2]];
  });
}

}  // namespace layer
}  // namespace paged_cpu

#pragma GCC pop_options
