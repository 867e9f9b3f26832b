// Decode v3 on the cpu backend: one work item per (sequence, KV head, KV split), the G query heads
// of the GQA group together, one online-softmax pass per split, the splits merged by log-sum-exp.
//
// The split plan (paged/kernels/split_plan.py, made once per step from the batch's shape and the
// thread count) gives every sequence `num_splits` splits of `split_blocks` cache blocks, counted
// from the block holding the window's first position (0 without a window); a shorter sequence
// has empty trailing splits. Splits only exist to keep every thread busy when the batch has too
// few (sequence, KV head) pairs; with one split an item writes its output directly.
//
// Per block of a split: the K tile gives the G heads' logits (multiplied in cache order against
// the query chunk repeated to a vector's width, so an fp32 K tile is used in place and no
// reduction runs in a vectorised dimension), then each head's online softmax (a reference max
// and an exp-sum, rescaling only when the max passes the reference), then the weights times the
// V tile into sums folded onto 8 lanes per (head, dim), summed over the lanes once, at the
// split's end. Each K and V tile is read once per group, as in v1/v2, and the next block's tiles
// are prefetched; the logits never leave the block: no per-context buffer, no second pass.
//
// Masking: slots past seq_len and before the window get weight exactly 0 and their V is replaced
// by 0 (the cache may hold NaN there, and 0 * NaN is NaN); blocks wholly before the window are
// never read (their table entries may be stale). fp8 tiles are dequantised with the KV head's
// scale, ALiBi adds slope * (key - query position), and block-sparse attention skips a block no
// head of the group sees (never reading it) and gives weight 0 to the heads that do not see it.
// A split that sees nothing keeps exp-sum 0, which is its weight in the merge.
//
// This is the portable path (any CPU, any dtype). A bf16 query over a bf16 cache on a CPU with
// AVX512-BF16, and an fp32 query over an fp32 cache on any AVX-512 CPU, take decode_v3_grouped.h's
// split instead (v3_attend); the rest (plan, merge) is shared.
#pragma once

#include "common.h"
#include "decode_v3_grouped.h"
#include "prefill.h"  // exp_nonpositive
#include "v3_scratch.h"

namespace paged_cpu {

// The query pattern one K-tile vector multiplies: a K tile is [D/x][BS][x], so an x-chunk of the
// query repeats along each row of the tile; W = max(x, kLanes) floats hold one repetition unit.
template <int x>
constexpr int pattern_width() { return x < kLanes ? kLanes : x; }

// The G heads' query rows from `head0` as [G][D/x][W]: chunk c of head g repeated over W floats.
template <typename C>
inline void v3_load_query(const Args& a, int seq, int head0, int G, V3Scratch& s) {
  constexpr int x = x_of<C>(), W = pattern_width<x>();
  const int D = a.head_size;
  for (int g = 0; g < G; ++g) {
    load_query_row(a, seq * a.q_stride_seq + (head0 + g) * a.q_stride_head, D, s.q.data());
    float* dst = s.qx.data() + static_cast<int64_t>(g) * (D / x) * W;
    for (int c = 0; c < D / x; ++c)
      for (int i = 0; i < W; ++i) dst[c * W + i] = s.q[c * x + i % x];
  }
}

// p[g][off] = scale * q[g] . k[off] for every slot of the tile (masking is the caller's). The
// products run along the tile in cache order in pieces of 64 floats (8 AVX2 accumulators held in
// registers over the D/x chunks); each slot's x lanes are summed once, outside the vector loop.
template <int x, int BS>
inline void v3_logits(int G, int D, float scale, const float* qx, const float* kf, const char* sees, float* p) {
  constexpr int W = pattern_width<x>(), chunk = BS * x, piece = chunk < 64 ? chunk : 64;
  const int chunks = D / x;
  for (int g = 0; g < G; ++g) {
    if (sees && !sees[g]) continue;
    const float* q = qx + static_cast<int64_t>(g) * chunks * W;
    for (int base = 0; base < chunk; base += piece) {
      float part[piece] = {};  // [piece / x][x]
      for (int c = 0; c < chunks; ++c) {
        const float* qc = q + c * W;
        const float* kc = kf + c * chunk + base;
        for (int h = 0; h < piece / W; ++h) {
#pragma omp simd
          for (int i = 0; i < W; ++i) part[h * W + i] += qc[i] * kc[h * W + i];
        }
      }
      for (int off = 0; off < piece / x; ++off) {
        float dot = 0.f;
        for (int i = 0; i < x; ++i) dot += part[off * x + i];
        p[g * BS + base / x + off] = dot * scale;
      }
    }
  }
}

// Online softmax of head g's logits over slots [lo, hi) of a block starting at `start`: turns
// p into weights (0 outside), updates the reference and exp-sum, rescales the partial sums.
template <int BS>
inline void v3_softmax_row(const Args& a, V3Scratch& s, int g, int head, int query_pos, int start, int lo, int hi) {
  float* pr = s.p.data() + g * BS;
  if (a.alibi_slopes) add_alibi(pr, BS, a.alibi_slopes[head], start - query_pos);
  float block_max = pr[lo];
  for (int off = lo + 1; off < hi; ++off) block_max = std::max(block_max, pr[off]);
  raise_reference(s, g, block_max, static_cast<int64_t>(a.head_size) * kLanes);
  const float ref = s.ref[g];
#pragma omp simd
  for (int off = 0; off < BS; ++off) {  // the select keeps NaN logits of masked slots out of exp
    pr[off] = exp_nonpositive(off >= lo && off < hi ? pr[off] - ref : kMasked);
  }
  float total = 0.f;
  for (int off = lo; off < hi; ++off) total += pr[off];
  s.sum[g] += total;
}

// vacc[g][d][i] += sum_h p[g][h * kLanes + i] * v[d][h * kLanes + i] for the heads that see the
// block: the slots fold onto kLanes lanes (in a fixed order, so no reassociation is needed), which
// divides the accumulators' loads and stores by BS / kLanes.
template <int BS>
inline void v3_values(int G, int D, const float* vf, const float* p, const char* sees, float* vacc) {
  for (int g = 0; g < G; ++g) {
    if (sees && !sees[g]) continue;
    const float* pg = p + g * BS;
    float* acc = vacc + static_cast<int64_t>(g) * D * kLanes;
    for (int d = 0; d < D; ++d) {
      const float* vd = vf + d * BS;
      float* ad = acc + d * kLanes;
#pragma omp simd
      for (int i = 0; i < kLanes; ++i) {
        float t = ad[i];
        for (int h = 0; h < BS / kLanes; ++h) t += pg[h * kLanes + i] * vd[h * kLanes + i];
        ad[i] = t;
      }
    }
  }
}

// The G heads of KV head `kvh` over blocks [b_begin, b_end) of a context of L tokens whose window
// starts at `first`: s.o gets the normalised output, s.ref / s.sum the reference max and exp-sum.
template <typename C, int BS>
void v3_attend_split(const Args& a, V3Scratch& s, int kvh, const int32_t* table, int L, int first, int b_begin,
                     int b_end) {
  using S = typename C::storage;
  constexpr int x = x_of<C>();
  const int G = a.num_heads / a.num_kv_heads, D = a.head_size, head0 = kvh * G, query_pos = L - 1;
  const float k_scale = kv_scale(a.k_scale, kvh), v_scale = kv_scale(a.v_scale, kvh);
  const char* sees = a.sparse.on() ? s.sees.data() : nullptr;
  std::fill(s.ref.begin(), s.ref.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.end(), 0.f);
  for (int b = b_begin; b < b_end; ++b) {
    const int start = b * BS;
    const int lo = std::max(first - start, 0), hi = std::min(BS, L - start);
    // a block no head sees is never read
    if (sees && !a.sparse.mark_group(s.sees.data(), query_pos, start, head0, G)) continue;
    if (b + 1 < b_end) prefetch_tiles<C>(a, table[b + 1], kvh);
    const S* k = tile_ptr<C>(a.key_cache, a, table[b], kvh);
    const float* kf;
    if constexpr (std::is_same_v<C, F32>) {
      kf = k;
    } else {
      for (int j = 0; j < D * BS; ++j) s.kt[j] = dequant<C>(k[j], k_scale);
      kf = s.kt.data();
    }
    v3_logits<x, BS>(G, D, a.scale, s.qx.data(), kf, sees, s.p.data());
    for (int g = 0; g < G; ++g)
      if (!sees || sees[g]) v3_softmax_row<BS>(a, s, g, head0 + g, query_pos, start, lo, hi);

    const S* v = tile_ptr<C>(a.value_cache, a, table[b], kvh);
    const bool whole = lo == 0 && hi == BS;
    const float* vf;
    if (std::is_same_v<C, F32> && whole) {
      vf = reinterpret_cast<const float*>(v);
    } else if (whole) {  // most blocks: one straight loop, which vectorises
      for (int j = 0; j < D * BS; ++j) s.vt[j] = dequant<C>(v[j], v_scale);
      vf = s.vt.data();
    } else {
      for (int d = 0; d < D; ++d)
        for (int off = 0; off < BS; ++off)
          s.vt[d * BS + off] = off >= lo && off < hi ? dequant<C>(v[d * BS + off], v_scale) : 0.f;
      vf = s.vt.data();
    }
    v3_values<BS>(G, D, vf, s.p.data(), sees, s.vacc.data());
  }
  v3_finish<kLanes>(s, G, D);
}

// One split of sequence `seq`'s KV head `kvh`: a bf16 query over a bf16 cache (on AVX512-BF16) and
// an fp32 one over an fp32 cache (on AVX-512) take the grouped path (decode_v3_grouped.h), everything
// else the portable one.
template <typename C, int BS>
void v3_attend(const Args& a, V3Scratch& s, int seq, int kvh, int L, int first, int b_begin, int b_end) {
  const int G = a.num_heads / a.num_kv_heads, head0 = kvh * G;
  const int32_t* table = a.block_tables + seq * a.bt_stride;
  if constexpr (kBf16Dot && std::is_same_v<C, BF16>) {
    if (a.dtype == kBF16) {
      bf16_load_query(a, seq, head0, G, G, s.qb.data());
      v3_attend_split_grouped<C, BS>(a, s, s.qb.data(), kvh, table, L, first, b_begin, b_end);
      return;
    }
  }
  if constexpr (kF32Tiles && std::is_same_v<C, F32>) {
    if (a.dtype == kF32) {
      for (int g = 0; g < G; ++g)
        load_query_row(a, seq * a.q_stride_seq + (head0 + g) * a.q_stride_head, a.head_size,
                       s.qf.data() + g * a.head_size);
      v3_attend_split_grouped<C, BS>(a, s, s.qf.data(), kvh, table, L, first, b_begin, b_end);
      return;
    }
  }
  v3_load_query<C>(a, seq, head0, G, s);
  v3_attend_split<C, BS>(a, s, kvh, table, L, first, b_begin, b_end);
}

// The split plan's coverage, checked before anything runs: 0, or the status code (13: counts out
// of range, 14: the splits cannot hold the blocks a row of max_seq_len attends to).
inline int check_split_plan(const Args& a, const SplitArgs& plan) {
  if (plan.num_splits < 1 || plan.num_splits > kMaxSplits || plan.split_blocks < 1) return 13;
  const int64_t bs = a.block_size, len = std::max(a.max_seq_len, 0);
  int64_t needed = (len + bs - 1) / bs;
  if (a.sliding_window > 0) needed = std::min(needed, (a.sliding_window + bs - 1 + bs - 1) / bs);
  return static_cast<int64_t>(plan.num_splits) * plan.split_blocks >= needed ? 0 : 14;
}

template <typename C, int BS>
void run_v3(const Args& a, const SplitArgs& plan) {
  const int G = a.num_heads / a.num_kv_heads, D = a.head_size, P = plan.num_splits;
  // Per (sequence, query head, split): reference max, exp-sum and normalised output. One split
  // needs none: its items write the output.
  const int64_t rows = static_cast<int64_t>(a.num_seqs) * a.num_heads;
  std::vector<float> part_ref, part_sum, part_out;
  if (P > 1) {
    part_ref.resize(rows * P);
    part_sum.resize(rows * P);
    part_out.resize(rows * P * D);
  }
  const int64_t items = rows / G * P;
#pragma omp parallel num_threads(a.num_threads)
  {
    V3Scratch s;
    s.init(G, D, BS);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int split = static_cast<int>(item % P);
      const int kvh = static_cast<int>(item / P % a.num_kv_heads);
      const int seq = static_cast<int>(item / P / a.num_kv_heads);
      const int head0 = kvh * G;
      const int L = std::min(a.seq_lens[seq], a.max_seq_len);  // the plan covers max_seq_len
      const int first = L > 0 ? window_start(a, L - 1) : 0;
      // int64: a plan's split_blocks is only bounded below
      const int64_t b_begin = first / BS + static_cast<int64_t>(split) * plan.split_blocks;
      const int64_t b_end = std::min<int64_t>(b_begin + plan.split_blocks, (L + BS - 1) / BS);
      if (b_begin < b_end) {
        v3_attend<C, BS>(a, s, seq, kvh, L, first, static_cast<int>(b_begin), static_cast<int>(b_end));
      } else {  // past the context (or an empty sequence): weight 0
        std::fill(s.o.begin(), s.o.end(), 0.f);
        std::fill(s.ref.begin(), s.ref.end(), -std::numeric_limits<float>::infinity());
        std::fill(s.sum.begin(), s.sum.end(), 0.f);
      }
      const int64_t row0 = static_cast<int64_t>(seq) * a.num_heads + head0;
      if (P == 1) {
        store_out_row(a, row0 * D, G * D, s.o.data());
        continue;
      }
      for (int g = 0; g < G; ++g) {
        const int64_t at = (row0 + g) * P + split;
        part_ref[at] = s.ref[g];
        part_sum[at] = s.sum[g];
        std::copy(s.o.begin() + g * D, s.o.begin() + (g + 1) * D, part_out.begin() + at * D);
      }
    }
    if (P > 1) {
      // Merge (after the loop's barrier): weight_p = sum_p * exp(ref_p - max ref), over the
      // splits that saw something; a row that saw nothing (an empty sequence) gets zeros.
#pragma omp for schedule(static)
      for (int64_t row = 0; row < rows; ++row) {
        const float* ref = part_ref.data() + row * P;
        const float* sum = part_sum.data() + row * P;
        float top = -std::numeric_limits<float>::infinity();
        for (int p = 0; p < P; ++p)
          if (sum[p] > 0.f) top = std::max(top, ref[p]);
        float* o = s.o.data();
        std::fill(o, o + D, 0.f);
        float total = 0.f;
        for (int p = 0; p < P; ++p) {
          if (!(sum[p] > 0.f)) continue;
          const float w = sum[p] * std::exp(ref[p] - top);
          total += w;
          const float* src = part_out.data() + (row * P + p) * D;
          for (int d = 0; d < D; ++d) o[d] += w * src[d];
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int d = 0; d < D; ++d) o[d] *= inv;
        store_out_row(a, row * D, D, o);
      }
    }
  }
}

}  // namespace paged_cpu
