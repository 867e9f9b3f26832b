// Decode v3's split with its tiles in AVX-512 registers (vec_tiles.h), for a bf16 query over a
// bf16 cache on AVX512-BF16 and an fp32 query over an fp32 cache on any AVX-512 CPU: the same
// split, online softmax and masking as decode_v3.h's portable path, with two changes measured on
// SmolLM2's shape (G = 3, D = 64, BS = 16) where each block's work is small.
//
// - The tiles are never converted to fp32 scratch: K through vdpbf16ps or FMAs, V read into
//   registers, fp32 V FMA'd, bf16 V multiplied pairwise on vdpbf16ps against weights rounded to
//   bf16 (vec_values_pairs: 18% less decode attention time end to end than widening V to fp32,
//   with the prefetch below).
// - Blocks go in groups of kGroupSlots / BS (4 at BS = 16): the group's logits and softmax first
//   (one max and rescale per group), then one pass over the value sums, [G][D][E] floats that
//   each pass loads and stores whole (a profile of the per-block version put its hottest
//   instructions on those loads and stores).
//   Under block-sparse attention each block has its own set of heads, so groups hold one block.
//
// Masking is the portable path's: weights of slots before the window or past the context are
// exactly 0 (their logits, possibly NaN, never reach exp), their V slots are zeroed as they are
// read, and a block no head sees is never read. The next three groups' tiles are prefetched.
#pragma once

#include "vec_tiles.h"
#include "common.h"
#include "prefill.h"  // exp_nonpositive, kMasked
#include "v3_scratch.h"

namespace paged_cpu {

// Online softmax of head g's logits over slots [lo, hi) of a group (p row of kGroupSlots, slot
// `off` at position start + off): as v3_softmax_row, for a group; E lanes per dim in the sums.
template <int E, bool kRound>
inline void v3_softmax_group(const Args& a, V3Scratch& s, int g, int head, int query_pos, int start, int lo,
                             int hi) {
  constexpr int P = kGroupSlots;
  float* pr = s.p.data() + g * P;
  if (a.alibi_slopes) add_alibi(pr, P, a.alibi_slopes[head], start - query_pos);
  const float group_max = max_in<P>(pr, lo, hi);
  raise_reference(s, g, group_max, static_cast<int64_t>(a.head_size) * E);
  const float ref = s.ref[g];
#pragma omp simd
  for (int off = 0; off < P; ++off) {  // the select keeps NaN logits of masked slots out of exp
    pr[off] = exp_nonpositive(off >= lo && off < hi ? pr[off] - ref : kMasked);
  }
  if constexpr (kRound) round_to_bf16<P>(pr);  // the weights vec_values_pairs multiplies
  s.sum[g] += sum_of<P>(pr);  // masked slots are exactly 0
}

// decode_v3.h's v3_attend_split for a query (`q`, [G][D]) over a cache of the same element type,
// C = BF16 or F32.
template <typename C, int BS>
void v3_attend_split_grouped(const Args& a, V3Scratch& s, const typename C::storage* q, int kvh, const int32_t* table,
                             int L, int first, int b_begin, int b_end) {
  using S = typename C::storage;
  // bf16 tiles take their values on pair products (E = BS / 2 lanes per dim), fp32 ones on FMAs
  constexpr bool kPairs = std::is_same_v<C, BF16>;
  constexpr int NB = kGroupSlots / BS, P = kGroupSlots, E = kPairs ? pair_lanes<BS>() : tile_lanes<BS>();
  const int G = a.num_heads / a.num_kv_heads, D = a.head_size, head0 = kvh * G, query_pos = L - 1;
  const char* sees = a.sparse.on() ? s.sees.data() : nullptr;
  const int step = sees ? 1 : NB;
  std::fill(s.ref.begin(), s.ref.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.end(), 0.f);
  const S* v_tiles[NB];
  for (int b = b_begin; b < b_end; b += step) {
    const int nb = std::min(step, b_end - b), start = b * BS;
    const int lo = std::max(first - start, 0), hi = std::min(nb * BS, L - start);
    // a block no head sees is never read
    if (sees && !a.sparse.mark_group(s.sees.data(), query_pos, start, head0, G)) continue;
    // The next group into L2 and the two after it toward L2 (asked again as they come nearer):
    // SmolLM2's shape, tiles scattered, 2 threads, 10-15% faster at every context than the next
    // group into L1 and one after (that prefetch evicted the group in use and the value sums
    // from L1), the same as three after; asking each group once, at any distance, was slower.
    for (int next = b + nb; next < std::min(b + nb + step, b_end); ++next) prefetch_tiles<C, 2>(a, table[next], kvh);
    for (int next = b + nb + step; next < std::min(b + nb + 3 * step, b_end); ++next)
      prefetch_tiles<C, 1>(a, table[next], kvh);
    for (int i = 0; i < nb; ++i) {
      const S* k = tile_ptr<C>(a.key_cache, a, table[b + i], kvh);
      v_tiles[i] = tile_ptr<C>(a.value_cache, a, table[b + i], kvh);
      vec_logits<BS>(G, D, a.scale, q, k, sees, s.p.data() + i * BS, P);
    }
    for (int g = 0; g < G; ++g)
      if (!sees || sees[g]) v3_softmax_group<E, kPairs>(a, s, g, head0 + g, query_pos, start, lo, hi);
    if constexpr (kPairs) {
      vec_values_pairs<BS, NB>(G, D, v_tiles, nb, lo, hi, s.p.data(), P, sees, s.vacc.data());
    } else {
      vec_values<BS, NB>(G, D, v_tiles, nb, lo, hi, s.p.data(), P, sees, s.vacc.data());
    }
  }
  v3_finish<E>(s, G, D);
}

}  // namespace paged_cpu
