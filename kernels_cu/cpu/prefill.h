// Prefill attention over the paged cache for a variable-length batch (backend "cpu").
//
// Sequence s owns query rows query_start_loc[s] .. query_start_loc[s + 1]; they are the last q_len
// of its seq_lens[s] context positions, and attend causally to the context read straight from the
// cache through the block table (q_len < seq_len after a prefix-cache hit or for a prefill chunk;
// q_len == 1 is a decode row). With a sliding window W, the query at p sees p - W < k <= p, and a
// tile starts at the block holding its first query's window start.
//
// Work items are (sequence, KV head, tile of kTileQ queries), scheduled dynamically and handed
// out from the end, so a sequence's late tiles (which see the most context) start early. A tile
// holds the G query heads of the KV head for each of its queries, R = G * tile rows, so each K/V
// block is converted to fp32 once per tile and used by all R rows. Per block: logits by a
// register-blocked [rows x block] product against the K tile transposed to [D][BS] (vectorised
// over the block's slots), an online softmax (running max and sum per row, flash-attention
// style), then the weighted values against the V tile transposed to [BS][D] (vectorised over D,
// register-blocked too). No floating-point reduction runs in a vectorised dimension and exp is a
// polynomial in plain IEEE arithmetic, so no -ffast-math is needed and results match the torch
// reference to ~1e-6 in fp32. The vectorised exp needs -fno-trapping-math (see cpu.py).
//
// Features, as in decode: an fp8 cache is dequantised as the tiles are converted to fp32, ALiBi
// adds slope * (key - query position) to a row's logits, and under block-sparse attention a row
// skips a block its head does not see from its query's sparse block, as a row skips one past its
// position; a block no row of the tile sees is never read.
//
// A bf16 query over a bf16 cache on AVX512-BF16 takes prefill_tile_grouped: the logits straight
// from the bf16 K tiles with vdpbf16ps (vec_tiles.h: no transposed fp32 copy; denormals flushed,
// pairs summed in fp32; one thread, SmolLM2's shape, 8 x 400-token prompts: 30.8 -> 23.6 ms per
// call), the values on vdpbf16ps pair products too (each V tile's slot pairs transposed once,
// each row's weights rounded to bf16 and broadcast a pair at a time over 16 dims; the fp32 path
// converts and transposes V element by element and FMAs it), and blocks in groups of 64 slots,
// so a row's softmax reductions and its value sums' loads and stores come once per group, not
// per block. Its results differ from fp32 weights by their rounding (2^-9 relative).
#pragma once

#include "vec_tiles.h"
#include "common.h"

namespace paged_cpu {

constexpr int kTileQ = 32;  // queries per work item
constexpr int kRowBlock = 4;  // rows that share each loaded K / V vector
constexpr int kWidth = 16;    // output columns per register block
constexpr float kMasked = -100.f;  // a logit offset whose exp is exactly 0

// exp(x) for x <= 0 (logits minus their running max) by Cephes' expf: range reduction by ln 2 and
// a degree-6 polynomial, < 2 ulp, written so the compiler vectorises it. Below -87.3 it returns 0.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.3f ? -87.3f : x;  // not std::max: its reference defeats vectorisation
  const float fx = clamped * 1.44269504088896341f;
  const int n = static_cast<int>(fx - 0.5f);  // round to nearest for fx <= 0
  const float fn = static_cast<float>(n);
  float r = clamped - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n, or 0 below the range.
  const float two_n = __builtin_bit_cast(float, x < -87.3f ? 0 : (n + 127) << 23);
  return p * two_n;
}

struct PrefillScratch {
  std::vector<float> q, o;  // [R][D], row r = query j * G + head g
  std::vector<uint16_t> qb; // [R][D]: the bf16 query (the bf16 path)
  std::vector<float> m, l;  // [R]: running max logit and exp-sum
  std::vector<float> p;     // [R][BS]: one block's logits, then their exps
  std::vector<float> kt;    // [D][BS]
  std::vector<float> vt;    // [BS][D]
  std::vector<uint32_t> vp; // [kGroupSlots/2][D]: a group's V tiles' slot pairs (the bf16 path)
  std::vector<uint16_t> pb; // [R][kGroupSlots]: the weights in bf16 (the bf16 path)
  std::vector<char> sees;   // block-sparse: [R] whether each row sees the current block

  void init(int rows, int D, int BS) {
    sees.resize(rows);
    q.resize(static_cast<size_t>(rows) * D);
    qb.resize(static_cast<size_t>(rows) * D);
    o.resize(static_cast<size_t>(rows) * D);
    m.resize(rows);
    l.resize(rows);
    p.resize(static_cast<size_t>(rows) * std::max(BS, kGroupSlots));
    kt.resize(static_cast<size_t>(D) * BS);
    vt.resize(static_cast<size_t>(D) * BS);
    vp.resize(static_cast<size_t>(D) * kGroupSlots / 2);
    pb.resize(static_cast<size_t>(rows) * kGroupSlots);
  }
};

// p[r][0..BS) = scale * q[r] . kt[:, 0..BS) for every row.
template <int BS>
inline void tile_logits(int R, int D, float scale, const float* q, const float* kt, float* p) {
  int r = 0;
  for (; r + kRowBlock <= R; r += kRowBlock) {
    float acc[kRowBlock][BS] = {};
    for (int d = 0; d < D; ++d) {
      const float* kd = kt + d * BS;
      for (int rr = 0; rr < kRowBlock; ++rr) {
        const float qv = q[(r + rr) * D + d];
#pragma omp simd
        for (int off = 0; off < BS; ++off) acc[rr][off] += qv * kd[off];
      }
    }
    for (int rr = 0; rr < kRowBlock; ++rr)
      for (int off = 0; off < BS; ++off) p[(r + rr) * BS + off] = acc[rr][off] * scale;
  }
  for (; r < R; ++r) {
    float acc[BS] = {};
    for (int d = 0; d < D; ++d) {
      const float qv = q[r * D + d];
#pragma omp simd
      for (int off = 0; off < BS; ++off) acc[off] += qv * kt[d * BS + off];
    }
    for (int off = 0; off < BS; ++off) p[r * BS + off] = acc[off] * scale;
  }
}

// o[r] += sum_off p[r][off] * vt[off] over off < n (p is 0 where a row may not look). Blocks of
// kRowBlock rows x kWidth columns of o stay in registers while the slots stream past.
template <int BS>
inline void tile_values(int R, int D, int n, const float* p, const float* vt, float* o) {
  const int r_end = R - R % kRowBlock, d_end = D - D % kWidth;
  for (int r = 0; r < r_end; r += kRowBlock)
    for (int d0 = 0; d0 < d_end; d0 += kWidth) {
      float acc[kRowBlock][kWidth];
      for (int rr = 0; rr < kRowBlock; ++rr)
        for (int i = 0; i < kWidth; ++i) acc[rr][i] = o[(r + rr) * D + d0 + i];
      for (int off = 0; off < n; ++off) {
        const float* v = vt + off * D + d0;
        for (int rr = 0; rr < kRowBlock; ++rr) {
          const float w = p[(r + rr) * BS + off];
#pragma omp simd
          for (int i = 0; i < kWidth; ++i) acc[rr][i] += w * v[i];
        }
      }
      for (int rr = 0; rr < kRowBlock; ++rr)
        for (int i = 0; i < kWidth; ++i) o[(r + rr) * D + d0 + i] = acc[rr][i];
    }
  // The rows and columns the blocks above leave over.
  for (int r = 0; r < R; ++r) {
    const int d_start = r < r_end ? d_end : 0;
    for (int off = 0; off < n; ++off) {
      const float w = p[r * BS + off];
      for (int d = d_start; d < D; ++d) o[r * D + d] += w * vt[off * D + d];
    }
  }
}

// Block-sparse: s.sees[r] = whether row r (query first_pos + r / G, head head0 + r % G) sees the
// block starting at `start`; false when no row does (the block is not read).
inline bool mark_sparse_rows(const Args& a, PrefillScratch& s, int first_pos, int start, int head0, int G, int R) {
  bool any = false;
  for (int r = 0; r < R; ++r) {
    s.sees[r] = a.sparse.sees(first_pos + r / G, start, a.sparse.offset(head0 + r % G, G));
    any |= s.sees[r];
  }
  return any;
}

// The tile's rows normalised by their exp-sums, into the output.
inline void store_tile(const Args& a, PrefillScratch& s, int row0, int head0, int nq, int G) {
  const int D = a.head_size;
  for (int j = 0; j < nq; ++j)
    for (int g = 0; g < G; ++g) {
      const int r = j * G + g;
      const float inv = 1.f / s.l[r];
      float* o = s.o.data() + r * D;
      for (int d = 0; d < D; ++d) o[d] *= inv;
      store_out_row(a, (static_cast<int64_t>(row0 + j) * a.num_heads + head0 + g) * D, D, o);
    }
}

// Row r's online-softmax step once its logits' max over the visible slots is known: the running
// max raised to it (its value sums and exp-sum rescaled), returned.
inline float raise_row_max(PrefillScratch& s, int r, int D, float block_max) {
  const float m_old = s.m[r], m_new = std::max(m_old, block_max);
  if (m_new != m_old) {
    const float alpha = std::exp(m_old - m_new);  // 0 on the first block (m_old = -inf)
    float* orow = s.o.data() + r * D;
    for (int d = 0; d < D; ++d) orow[d] *= alpha;
    s.l[r] *= alpha;
    s.m[r] = m_new;
  }
  return m_new;
}

// One work item: queries j0 .. j0 + nq of sequence `seq`, the G heads of KV head `kvh`.
template <typename C, int BS>
void prefill_tile(const Args& a, PrefillScratch& s, int seq, int kvh, int j0, int nq) {
  using S = typename C::storage;
  constexpr int x = x_of<C>();
  const int G = a.num_heads / a.num_kv_heads, D = a.head_size, R = nq * G, head0 = kvh * G;
  const int row0 = a.query_start_loc[seq] + j0;
  const int first_pos = a.seq_lens[seq] - (a.query_start_loc[seq + 1] - a.query_start_loc[seq]) + j0;
  for (int j = 0; j < nq; ++j)
    for (int g = 0; g < G; ++g)
      load_query_row(a, (row0 + j) * a.q_stride_seq + (head0 + g) * a.q_stride_head, D,
                     s.q.data() + (j * G + g) * D);
  std::fill(s.o.begin(), s.o.begin() + R * D, 0.f);
  std::fill(s.m.begin(), s.m.begin() + R, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + R, 0.f);

  const int32_t* table = a.block_tables + seq * a.bt_stride;
  const int last_pos = first_pos + nq - 1;
  const float k_scale = kv_scale(a.k_scale, kvh), v_scale = kv_scale(a.v_scale, kvh);
  // The tile's first query reaches back furthest; blocks before its window are never read.
  const int tile_window = window_start(a, first_pos);
  for (int b = tile_window / BS; b <= last_pos / BS; ++b) {
    const int start = b * BS;
    // Slots this block holds for the tile's last query; none lies past seq_len, where the cache
    // may hold garbage.
    const int n = std::min(BS, last_pos - start + 1);
    // Slots before the tile's window, in its first block: no query sees them, and V there may
    // hold anything (0 * NaN is NaN), so they are zero.
    const int skip = std::max(tile_window - start, 0);
    if (a.sparse.on() && !mark_sparse_rows(a, s, first_pos, start, head0, G, R)) continue;
    const S* k = tile_ptr<C>(a.key_cache, a, table[b], kvh);
    const S* v = tile_ptr<C>(a.value_cache, a, table[b], kvh);
    for (int c = 0; c < D / x; ++c)
      for (int off = 0; off < BS; ++off)
        for (int i = 0; i < x; ++i) s.kt[(c * x + i) * BS + off] = dequant<C>(k[(c * BS + off) * x + i], k_scale);
    tile_logits<BS>(R, D, a.scale, s.q.data(), s.kt.data(), s.p.data());
    for (int off = 0; off < n; ++off)
      for (int d = 0; d < D; ++d) s.vt[off * D + d] = off < skip ? 0.f : dequant<C>(v[d * BS + off], v_scale);
    for (int r = 0; r < R; ++r) {
      float* pr = s.p.data() + r * BS;
      const int pos = first_pos + r / G;
      const int visible = std::min(n, pos - start + 1);  // causal: slots <= own position
      const int lo = std::max(window_start(a, pos) - start, 0);  // window: slots after pos - W
      if (visible <= lo || (a.sparse.on() && !s.sees[r])) {
        std::fill(pr, pr + BS, 0.f);
        continue;
      }
      if (a.alibi_slopes) add_alibi(pr, BS, a.alibi_slopes[head0 + r % G], start - pos);
      float block_max = pr[lo];
      for (int off = lo + 1; off < visible; ++off) block_max = std::max(block_max, pr[off]);
      const float m_new = raise_row_max(s, r, D, block_max);
#pragma omp simd
      for (int off = 0; off < BS; ++off) {
        const float shifted = pr[off] - m_new;
        pr[off] = exp_nonpositive(off >= lo && off < visible ? shifted : kMasked);
      }
      float sum = 0.f;
      for (int off = lo; off < visible; ++off) sum += pr[off];
      s.l[r] += sum;
    }
    tile_values<BS>(R, D, n, s.p.data(), s.vt.data(), s.o.data());
  }

  store_tile(a, s, row0, head0, nq, G);
}

// prefill_tile for a bf16 query over a bf16 cache on AVX512-BF16, with decode_v3_grouped.h's
// changes: the logits straight from the bf16 K tiles on vdpbf16ps (vec_tiles.h), and blocks in
// groups of kGroupSlots / BS (one block under block-sparse attention, whose rows see blocks one
// by one): per row one max, at most one rescale and one exp-sum per group, the weights rounded to
// bf16 (the exp-sum adds the rounded ones), then the group's values on pair products
// (pair_tile_values over its V tiles' transposed slot pairs, never converted to fp32).
template <int BS>
void prefill_tile_grouped(const Args& a, PrefillScratch& s, int seq, int kvh, int j0, int nq) {
  constexpr int NB = kGroupSlots / BS, P = kGroupSlots;
  const int G = a.num_heads / a.num_kv_heads, D = a.head_size, R = nq * G, head0 = kvh * G;
  const int row0 = a.query_start_loc[seq] + j0;
  const int first_pos = a.seq_lens[seq] - (a.query_start_loc[seq + 1] - a.query_start_loc[seq]) + j0;
  bf16_load_query(a, row0, head0, G, R, s.qb.data());
  std::fill(s.o.begin(), s.o.begin() + R * D, 0.f);
  std::fill(s.m.begin(), s.m.begin() + R, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + R, 0.f);

  const int32_t* table = a.block_tables + seq * a.bt_stride;
  const int last_pos = first_pos + nq - 1, b_end = last_pos / BS + 1;
  const int tile_window = window_start(a, first_pos);  // blocks before it are never read
  const bool sparse = a.sparse.on();
  const int step = sparse ? 1 : NB;
  for (int b = tile_window / BS; b < b_end; b += step) {
    const int nb = std::min(step, b_end - b), start = b * BS;
    // The group's slots up to the tile's last query (none past seq_len, where the cache may hold
    // garbage) and from the tile's window (V before it may hold anything: 0 * NaN is NaN).
    const int n = std::min(nb * BS, last_pos - start + 1), skip = std::max(tile_window - start, 0);
    if (sparse && !mark_sparse_rows(a, s, first_pos, start, head0, G, R)) continue;
    for (int i = 0; i < nb; ++i) {
      const uint16_t* k = tile_ptr<BF16>(a.key_cache, a, table[b + i], kvh);
      const uint16_t* v = tile_ptr<BF16>(a.value_cache, a, table[b + i], kvh);
      vec_logits<BS>(R, D, a.scale, s.qb.data(), k, sparse ? s.sees.data() : nullptr, s.p.data() + i * BS, P);
      pair_transpose_values<BS>(v, D, skip - i * BS, n - i * BS, s.vp.data() + static_cast<int64_t>(i) * BS / 2 * D);
    }
    for (int r = 0; r < R; ++r) {
      float* pr = s.p.data() + r * P;
      const int pos = first_pos + r / G;
      const int visible = std::min(n, pos - start + 1);  // causal: slots <= own position
      const int lo = std::max(window_start(a, pos) - start, 0);  // window: slots after pos - W
      if (visible <= lo || (sparse && !s.sees[r])) {
        std::fill(pr, pr + P, 0.f);
        continue;
      }
      if (a.alibi_slopes) add_alibi(pr, P, a.alibi_slopes[head0 + r % G], start - pos);
      const float m = raise_row_max(s, r, D, max_in<P>(pr, lo, visible));
#pragma omp simd
      for (int off = 0; off < P; ++off) {  // the select keeps NaN logits of masked slots out of exp
        pr[off] = exp_nonpositive(off >= lo && off < visible ? pr[off] - m : kMasked);
      }
      round_to_bf16<P>(pr);  // the weights pair_tile_values multiplies, so the sum adds them
      s.l[r] += sum_of<P>(pr);  // masked slots are exactly 0
    }
    pair_tile_values(R, D, s.p.data(), P, nb * BS / 2, s.vp.data(), s.o.data(), s.pb.data());
  }
  store_tile(a, s, row0, head0, nq, G);
}

template <typename C, int BS>
void run_prefill(const Args& a) {
  // tile_start[s]: index of sequence s's first query tile.
  std::vector<int64_t> tile_start(a.num_seqs + 1, 0);
  for (int s = 0; s < a.num_seqs; ++s) {
    const int q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    tile_start[s + 1] = tile_start[s] + (q_len + kTileQ - 1) / kTileQ;
  }
  const int64_t items = tile_start[a.num_seqs] * a.num_kv_heads;
  const int G = a.num_heads / a.num_kv_heads;
#pragma omp parallel num_threads(a.num_threads)
  {
    PrefillScratch s;
    s.init(G * std::min(kTileQ, std::max(a.max_query_len, 1)), a.head_size, BS);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = items - 1; item >= 0; --item) {
      const int64_t tile = item / a.num_kv_heads;
      const int kvh = static_cast<int>(item % a.num_kv_heads);
      const int seq = static_cast<int>(std::upper_bound(tile_start.begin(), tile_start.end(), tile) -
                                       tile_start.begin()) - 1;
      const int j0 = static_cast<int>(tile - tile_start[seq]) * kTileQ;
      const int q_len = a.query_start_loc[seq + 1] - a.query_start_loc[seq];
      const int nq = std::min(kTileQ, q_len - j0);
      if constexpr (kBf16Dot && std::is_same_v<C, BF16>) {
        if (a.dtype == kBF16) {
          prefill_tile_grouped<BS>(a, s, seq, kvh, j0, nq);
          continue;
        }
      }
      prefill_tile<C, BS>(a, s, seq, kvh, j0, nq);
    }
  }
}

}  // namespace paged_cpu
