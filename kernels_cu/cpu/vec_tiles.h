// Attention tiles in AVX-512 registers, without converting them to fp32 scratch first: a bf16 query
// against a bf16 cache on AVX512-BF16 (decode v3's and prefill's fast path when both are bf16),
// and an fp32 query against an fp32 cache on any AVX-512 CPU (decode v3's grouped path).
//
// Logits: a K tile is [D/x][BS][x] with x = 16 bytes of elements (8 bf16, 4 fp32), so one
// 512-bit load holds 4 consecutive slots of an x-dim chunk; it is multiplied by the query's chunk
// broadcast 4 times into 16 fp32 lanes (lane 4s + j: slot s's part j): vdpbf16ps adds bf16 pairs,
// fp32 takes FMAs. Over the D/x chunks each row keeps BS/4 such accumulators; fold4 then sums each
// slot's 4 lanes and puts the slots in order. Values: a V tile is [D][BS]; fp32 ones are read 16
// elements at a time, masked slots zeroed by the same load (the cache may hold NaN there, and
// 0 * NaN is NaN), and multiplied by the weights into sums folded onto E = min(BS, 16) lanes per
// (row, dim), summed over the lanes by the caller; bf16 ones (vec_values_pairs) are multiplied two
// slots at a time by vdpbf16ps into BS / 2 lanes per (row, dim).
//
// Precision: vdpbf16ps treats denormal inputs as 0, flushes denormal results and rounds each pair
// sum to fp32 (not one fused product per element), so bf16 logits differ from the fp32-converting
// path by a few fp32 ulps. The bf16 pair products take the weights rounded to bf16 (2^-9
// relative, the bf16 output's own rounding; the exp-sum adds the rounded ones); fp32's stay fp32.
// fp32 tiles sum the same products in another order than the portable path (a few ulps too).
// Attention's tolerance to the float64 reference is far above that. Compiled only where the
// compiler targets AVX-512 (-march=native on such a CPU), the bf16 dot only with AVX512-BF16:
// kF32Tiles and kBf16Dot say whether.
#pragma once

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace paged_cpu {

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif
// fp32 tiles take the same path on any AVX-512 CPU: FMAs where bf16 takes vdpbf16ps.
#if defined(__AVX512F__)
constexpr bool kF32Tiles = true;
#else
constexpr bool kF32Tiles = false;
#endif

// Lanes of the folded value sums for block size BS: a 16-float vector holds 16 / E rows of V.
template <int BS>
constexpr int tile_lanes() { return BS < 16 ? BS : 16; }
// Lanes of the bf16 pair-product value sums (vec_values_pairs): one per slot pair.
template <int BS>
constexpr int pair_lanes() { return BS / 2; }

// Rows (query heads) of the bf16 query as raw bf16 bits, [rows][D] contiguous: row r is head
// `head0 + r % G` of query row `row0 + r / G`.
inline void bf16_load_query(const Args& a, int64_t row0, int head0, int G, int rows, uint16_t* dst) {
  const uint16_t* q = static_cast<const uint16_t*>(a.query);
  const int D = a.head_size;
  for (int r = 0; r < rows; ++r) {
    const uint16_t* src = q + (row0 + r / G) * a.q_stride_seq + (head0 + r % G) * a.q_stride_head;
    for (int d = 0; d < D; ++d) dst[r * D + d] = src[d * a.q_stride_dim];
  }
}

#if defined(__AVX512F__)

// Lane 4s + j of a, b, c, d holds part j of slot s, 4 + s, 8 + s, 12 + s: the slots' sums, in order.
inline __m512 fold4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Per 128-bit lane k: 0x88 picks elements 0, 2 of each source, 0xDD elements 1, 3.
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(c, d, 0x88), _mm512_shuffle_ps(c, d, 0xDD));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x88), _mm512_shuffle_ps(ab, cd, 0xDD));
  // Lane 4k + j of r is slot 4j + k.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// One 64-byte piece of a K tile (4 slots of a 16-byte chunk of dims) times the query's chunk `qc`
// (broadcast to the 4 slots), added into acc: fp32 FMAs, or bf16 pair products on vdpbf16ps.
inline __m512 dot_piece(__m512 acc, __m512i qc, const float* k) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(qc), _mm512_loadu_ps(k), acc);
}
#if defined(__AVX512BF16__)
inline __m512 dot_piece(__m512 acc, __m512i qc, const uint16_t* k) {
  return _mm512_dpbf16_ps(acc, (__m512bh)qc, (__m512bh)_mm512_loadu_si512(k));
}
#endif

// p[r * ps + 0..BS) = scale * q[r] . k[slot] for the rows whose `sees` is set (all without `sees`):
// q [rows][D] and the K tile [D/x][BS][x] of one element type T (x = 16 / sizeof(T)).
template <int BS, typename T>
inline void vec_logits(int rows, int D, float scale, const T* q, const T* k, const char* sees, float* p, int ps) {
  constexpr int R = BS / 4, X = 16 / static_cast<int>(sizeof(T));  // accumulators per row; dims per chunk
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r = 0; r < rows; ++r) {
    if (sees && !sees[r]) continue;
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    const T* qr = q + r * D;
    for (int c = 0; c < D / X; ++c) {
      const __m512i qc = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + c * X)));
      const T* kc = k + c * BS * X;
      for (int i = 0; i < R; ++i) acc[i] = dot_piece(acc[i], qc, kc + i * 4 * X);
    }
    float* pr = p + r * ps;
    if constexpr (R < 4) {  // BS = 8: 8 slots
      const __m512 z = _mm512_setzero_ps();
      _mm512_mask_storeu_ps(pr, 0xff, _mm512_mul_ps(fold4(acc[0], acc[1], z, z), vscale));
    } else {
      for (int i = 0; i < R; i += 4)
        _mm512_storeu_ps(pr + i * 4, _mm512_mul_ps(fold4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]), vscale));
    }
  }
}

// The largest of p[lo .. hi) (0 <= lo < hi <= P, P a multiple of 8); other slots may hold NaN,
// and only p[0 .. P) is read.
template <int P>
inline float max_in(const float* p, int lo, int hi) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int off = 0; off < P; off += 16) {
    const int a = std::clamp(lo - off, 0, 16), b = std::clamp(hi - off, 0, 16);
    const __mmask16 in = static_cast<__mmask16>(((1u << b) - 1) & ~((1u << a) - 1));
    m = _mm512_mask_max_ps(m, in, m, _mm512_maskz_loadu_ps(in, p + off));
  }
  return _mm512_reduce_max_ps(m);
}

// The sum of p[0 .. P) (P a multiple of 8), in vectors: the order differs from a running sum.
template <int P>
inline float sum_of(const float* p) {
  __m512 t = _mm512_setzero_ps();
  for (int off = 0; off < P; off += 16)
    t = _mm512_add_ps(t, _mm512_maskz_loadu_ps(P - off >= 16 ? 0xffff : 0xff, p + off));
  return _mm512_reduce_add_ps(t);
}

// The bits of the slots [lo, hi) of a block (both clamped to [0, BS)).
template <int BS>
inline uint64_t slot_bits(int lo, int hi) {
  lo = std::clamp(lo, 0, BS);
  hi = std::clamp(hi, 0, BS);
  return ((uint64_t{1} << hi) - 1) & ~((uint64_t{1} << lo) - 1);
}

// acc[r][d][0..E) += sum over the group's blocks i < nb of fp32 V tile v[i]'s row d times the weights
// p[r * ps + i * BS + 0..BS), folded onto E lanes (slot s on lane s % E), for the rows whose
// `sees` is set. Slot lo .. hi - 1 of the group (block i holds its slots i * BS ..) are read;
// the others as 0 (masked lanes are not read: the cache may hold NaN there, and 0 * NaN is NaN),
// and blocks from nb on not at all (their weights must be 0). Rows go RB at a time with their
// weights held in registers: measured 10-25% faster on SmolLM2's shape than reading a weight with
// each FMA. (bf16 tiles take vec_values_pairs.)
template <int BS, int NB>
inline void vec_values(int rows, int D, const float* const* v, int nb, int lo, int hi, const float* p, int ps,
                       const char* sees, float* acc) {
  constexpr int E = tile_lanes<BS>(), H = BS / E;  // H: vectors per V row (1 for BS = 8: 2 rows per vector)
  __mmask16 mask[NB][H];
  const float* tile[NB];
  for (int i = 0; i < NB; ++i) {
    const uint64_t slots = i < nb ? slot_bits<BS>(lo - i * BS, hi - i * BS) : 0;
    tile[i] = v[i < nb ? i : 0];  // a readable address; its mask is 0
    for (int h = 0; h < H; ++h)
      mask[i][h] = E == 16 ? static_cast<__mmask16>(slots >> (16 * h)) : static_cast<__mmask16>(slots | slots << 8);
  }
  const int vectors = D * E / 16;  // accumulator vectors per row
  constexpr int W = NB * H;            // weight vectors per row
  constexpr int RB = W <= 4 ? 4 : 2;   // rows whose weights stay in registers (W * RB <= 16)
  for (int r0 = 0; r0 < rows; r0 += RB) {
    __m512 w[RB][W];
    bool on[RB];
    for (int rr = 0; rr < RB; ++rr) {
      on[rr] = r0 + rr < rows && (!sees || sees[r0 + rr]);
      for (int k = 0; k < W; ++k) {
        const float* src = p + (r0 + rr) * ps + (k / H) * BS + (k % H) * 16;
        w[rr][k] = !on[rr] ? _mm512_setzero_ps()
                   : E == 16 ? _mm512_loadu_ps(src) : _mm512_broadcast_f32x8(_mm256_loadu_ps(src));
      }
    }
    for (int j = 0; j < vectors; ++j) {
      __m512 vf[W];
      for (int k = 0; k < W; ++k) {
        vf[k] = _mm512_maskz_loadu_ps(mask[k / H][k % H], tile[k / H] + (j * H + k % H) * 16);
      }
      for (int rr = 0; rr < RB; ++rr) {
        if (!on[rr]) continue;
        float* ar = acc + (static_cast<int64_t>(r0 + rr) * D * E + j * 16);
        __m512 t[2] = {_mm512_loadu_ps(ar), _mm512_setzero_ps()};  // two chains: half the FMA latency
        for (int k = 0; k < W; ++k) t[k % 2] = _mm512_fmadd_ps(w[rr][k], vf[k], t[k % 2]);
        _mm512_storeu_ps(ar, _mm512_add_ps(t[0], t[1]));
      }
    }
  }
}

#if defined(__AVX512BF16__)
// bf16 values on vdpbf16ps. A 64-byte piece of a V tile ([D][BS] bf16) holds 32 / BS dims of BS
// slots each, so one vdpbf16ps multiplies two slots of a dim per lane: pair_lanes<BS>() lanes per
// dim (slot pair (2i, 2i + 1) on lane i), where vec_values widens each 16 values to fp32 (two
// instructions) and spends one FMA per 16 products. The weights must be bf16 values already
// (round_to_bf16 after the exps, so the exp-sum adds what the dot multiplies and the weights stay
// normalised, as flash-attention rounds P on tensor cores): converting them is exact.

// p[0 .. P) rounded to the nearest bf16 (ties to even), kept as fp32 (P a multiple of 8).
template <int P>
inline void round_to_bf16(float* p) {
  for (int off = 0; off < P; off += 16) {
    const __mmask16 m = P - off >= 16 ? 0xffff : 0xff;
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p + off));
    _mm512_mask_storeu_ps(p + off, m, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
}

// BS bf16-valued weights from p, repeated over a vector's 32 bf16 elements (one copy per dim).
template <int BS>
inline __m512i pair_weights(const float* p) {
  if constexpr (BS == 32) {
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
  } else {
    const __m512 w = BS == 16 ? _mm512_loadu_ps(p) : _mm512_broadcast_f32x8(_mm256_loadu_ps(p));
    return (__m512i)_mm512_cvtne2ps_pbh(w, w);
  }
}

// vec_values for bf16 tiles on pair products: acc[r][d][0 .. BS / 2) += the pair products of V
// tile v[i]'s row d and the weights p[r * ps + i * BS + 0 .. BS), for the rows whose `sees` is
// set; the group's slots outside lo .. hi - 1 are read as 0 and blocks from nb on not at all.
template <int BS, int NB>
inline void vec_values_pairs(int rows, int D, const uint16_t* const* v, int nb, int lo, int hi, const float* p,
                             int ps, const char* sees, float* acc) {
  static_assert(BS == 8 || BS == 16 || BS == 32, "a 64-byte piece holds whole V rows");
  constexpr int RB = NB <= 4 ? 4 : 2;  // rows whose weights stay in registers (NB * RB <= 16)
  __mmask32 mask[NB];
  const uint16_t* tile[NB];
  for (int i = 0; i < NB; ++i) {
    const uint64_t slots = i < nb ? slot_bits<BS>(lo - i * BS, hi - i * BS) : 0;
    uint64_t m = 0;
    for (int c = 0; c < 32 / BS; ++c) m |= slots << (c * BS);
    mask[i] = static_cast<__mmask32>(m);
    tile[i] = v[i < nb ? i : 0];  // a readable address; its mask is 0
  }
  const int pieces = D * BS / 32;  // 64-byte pieces of a tile, one sum vector each per row
  for (int r0 = 0; r0 < rows; r0 += RB) {
    __m512i w[RB][NB];
    bool on[RB];
    for (int rr = 0; rr < RB; ++rr) {
      on[rr] = r0 + rr < rows && (!sees || sees[r0 + rr]);
      for (int k = 0; k < NB; ++k)
        w[rr][k] = on[rr] ? pair_weights<BS>(p + (r0 + rr) * ps + k * BS) : _mm512_setzero_si512();
    }
    for (int j = 0; j < pieces; ++j) {
      __m512i vb[NB];
      for (int k = 0; k < NB; ++k) vb[k] = _mm512_maskz_loadu_epi16(mask[k], tile[k] + j * 32);
      for (int rr = 0; rr < RB; ++rr) {
        if (!on[rr]) continue;
        float* ar = acc + (static_cast<int64_t>(r0 + rr) * D * (BS / 2) + j * 16);
        __m512 t[2] = {_mm512_loadu_ps(ar), _mm512_setzero_ps()};  // two chains: half the latency
        for (int k = 0; k < NB; ++k) t[k % 2] = _mm512_dpbf16_ps(t[k % 2], (__m512bh)w[rr][k], (__m512bh)vb[k]);
        _mm512_storeu_ps(ar, _mm512_add_ps(t[0], t[1]));
      }
    }
  }
}

// Prefill's values on pair products (prefill.h's prefill_tile_grouped). The V tile ([D][BS] bf16) as
// vp[k][d] = the pair (V[d][2k], V[d][2k + 1]) in one 32-bit word, slots outside [lo, hi) 0 (the
// cache may hold NaN there): each row's weights then broadcast a pair at a time against 16 dims.
template <int BS>
inline void pair_transpose_values(const uint16_t* v, int D, int lo, int hi, uint32_t* vp) {
  const uint32_t keep = static_cast<uint32_t>(slot_bits<BS>(lo, hi));
  for (int k = 0; k < BS / 2; ++k) {
    const uint32_t mask = ((keep >> (2 * k)) & 1 ? 0xffffu : 0u) | ((keep >> (2 * k + 1)) & 1 ? 0xffff0000u : 0u);
    uint32_t* row = vp + static_cast<int64_t>(k) * D;
    for (int d = 0; d < D; ++d) {
      uint32_t pair;
      std::memcpy(&pair, v + d * BS + 2 * k, sizeof pair);
      row[d] = pair & mask;
    }
  }
}

// o[r][d0 .. d0 + 16 * NC) += the weights of rows r .. r + RB (pb: [R][ps] bf16 bits) times the
// first `pairs` slot pairs of vp.
template <int RB, int NC>
inline void pair_values_block(int D, const uint16_t* pb, int ps, int pairs, const uint32_t* vp, float* o, int r,
                              int d0) {
  __m512 acc[RB][NC];
  for (int rr = 0; rr < RB; ++rr)
    for (int c = 0; c < NC; ++c) acc[rr][c] = _mm512_loadu_ps(o + static_cast<int64_t>(r + rr) * D + d0 + 16 * c);
  for (int k = 0; k < pairs; ++k) {
    __m512i vk[NC];
    for (int c = 0; c < NC; ++c) vk[c] = _mm512_loadu_si512(vp + static_cast<int64_t>(k) * D + d0 + 16 * c);
    for (int rr = 0; rr < RB; ++rr) {
      uint32_t pair;
      std::memcpy(&pair, pb + static_cast<int64_t>(r + rr) * ps + 2 * k, sizeof pair);
      const __m512i w = _mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < NC; ++c) acc[rr][c] = _mm512_dpbf16_ps(acc[rr][c], (__m512bh)w, (__m512bh)vk[c]);
    }
  }
  for (int rr = 0; rr < RB; ++rr)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + static_cast<int64_t>(r + rr) * D + d0 + 16 * c, acc[rr][c]);
}

// o[r] += sum over the first 2 * pairs slots of p[r][slot] * V[slot] for every row: p [R][ps]
// holds bf16 values (round_to_bf16), 0 where a row may not look; vp [pairs][D] the V tiles'
// slot pairs (pair_transpose_values, one tile after the other); pb [R][ps] is scratch. 4 rows x
// 64 dims of o stay in registers while the pairs stream past. D is a multiple of 16.
inline void pair_tile_values(int R, int D, const float* p, int ps, int pairs, const uint32_t* vp, float* o,
                             uint16_t* pb) {
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * pairs; i += 16) {
      const __mmask16 m = 2 * pairs - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (2 * pairs - i)) - 1);
      const int64_t at = static_cast<int64_t>(r) * ps + i;
      _mm256_mask_storeu_epi16(pb + at, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p + at)));
    }
  constexpr int RB = 4, NC = 4;
  const int r_end = R - R % RB, d_end = D - D % (16 * NC);
  for (int r = 0; r < r_end; r += RB) {
    for (int d0 = 0; d0 < d_end; d0 += 16 * NC) pair_values_block<RB, NC>(D, pb, ps, pairs, vp, o, r, d0);
    for (int d0 = d_end; d0 < D; d0 += 16) pair_values_block<RB, 1>(D, pb, ps, pairs, vp, o, r, d0);
  }
  for (int r = r_end; r < R; ++r) {
    for (int d0 = 0; d0 < d_end; d0 += 16 * NC) pair_values_block<1, NC>(D, pb, ps, pairs, vp, o, r, d0);
    for (int d0 = d_end; d0 < D; d0 += 16) pair_values_block<1, 1>(D, pb, ps, pairs, vp, o, r, d0);
  }
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__

#if !defined(__AVX512BF16__)
// Declared for the callers' discarded `if constexpr (kPairs ...)` branches; never instantiated.
template <int P>
void round_to_bf16(float* p);
template <int BS, int NB>
void vec_values_pairs(int rows, int D, const uint16_t* const* v, int nb, int lo, int hi, const float* p, int ps,
                      const char* sees, float* acc);
template <int BS>
void pair_transpose_values(const uint16_t* v, int D, int lo, int hi, uint32_t* vp);
void pair_tile_values(int R, int D, const float* p, int ps, int pairs, const uint32_t* vp, float* o, uint16_t* pb);
#endif

#if !defined(__AVX512F__)
// Declared for the callers' discarded `if constexpr (kF32Tiles / kBf16Dot ...)` branches; never instantiated.
template <int BS, typename T>
void vec_logits(int rows, int D, float scale, const T* q, const T* k, const char* sees, float* p, int ps);
template <int P>
float max_in(const float* p, int lo, int hi);
template <int P>
float sum_of(const float* p);
template <int BS, int NB>
void vec_values(int rows, int D, const float* const* v, int nb, int lo, int hi, const float* p, int ps,
                const char* sees, float* acc);
#endif  // __AVX512F__

}  // namespace paged_cpu
