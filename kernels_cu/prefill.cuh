// Paged varlen prefill attention: causal attention of a batch of sequences' new queries to their
// whole context, read through the block tables straight from the paged cache (no gather, no copy).
//
// Sequence s owns query rows query_start_loc[s] .. query_start_loc[s + 1], the last q_len of its
// seq_lens[s] positions (q_len < seq_len after a prefix-cache hit or for a prefill chunk; q_len = 1
// is a decode row). The query at position p sees keys p - W < k <= p with a sliding window W
// (0: none), ALiBi adds slope * (k - p), a block-sparse pattern drops the blocks its head does not
// see from p's sparse block (attention.cuh's rule), and an fp8 cache is read as float(fp8) * scale
// of the KV head.
//
// Grid (row tiles, num_kv_heads, num_seqs). A CTA owns 64 rows of one sequence and one KV head,
// row r being query r / G of head r % G (G query heads per KV head), so each K/V tile it loads
// serves the whole group (the GQA reuse flash-decoding kernels get from packing heads). Its four
// warps own 16 rows each. Per tile of 32 keys, flash-attention 2's loop: the tile's K and V are
// read through the block table into shared memory (converted to T: fp8 values are exact in fp16
// and bf16; K row-major, V transposed so each head dim's keys are contiguous), S = Q·Kᵀ, the
// online softmax (running max and sum per row), O += P·V. fp16 and bf16 run both products on
// tensor cores (mma.cuh; P goes from the S accumulators into the A fragments without leaving
// registers, rounded to T as flash-attention does); fp32, and targets before sm_80, compute the
// same fragments on CUDA cores. Accumulation is fp32 throughout.
//
// Keys a tile does not need read as zeros and are never loaded: before the tile's first query's
// window (those blocks may have been freed and reused), past its last query (unwritten slots may
// hold NaN), and, under block-sparse attention, in sparse blocks no row of the tile sees. Masked
// logits are -inf, whatever the slot held. The k_scale is folded into the softmax scale and the
// v_scale into the final normalisation.
#pragma once

#include "attention.cuh"
#include "mma.cuh"

namespace paged {

constexpr int PREFILL_WARPS = 4;
constexpr int PREFILL_THREADS = PREFILL_WARPS * WARP_SIZE;
constexpr int PREFILL_ROWS = 16 * PREFILL_WARPS;  // query rows of a CTA: one m16 tile per warp
constexpr int PREFILL_KEYS = 32;                   // keys per K/V tile

// A cache element as T; the fp8 formats' values are all exact in fp16, bf16 and fp32.
template <typename T, typename C>
PAGED_DEVICE T cache_to(C x) {
  if constexpr (SameType<T, C>::value) {
    return x;
  } else {
    return from_float<T>(to_float(x));
  }
}

// A vector of cache elements into a shared-memory tile of T: one vector store when the cache holds
// T (the tile rows are 16-byte aligned), else element by element.
template <typename T, typename C, int N>
PAGED_DEVICE void store_tile(T* dst, const Vec<C, N>& v) {
  if constexpr (SameType<T, C>::value) {
    *reinterpret_cast<Vec<T, N>*>(dst) = v;
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) dst[e] = cache_to<T>(v.val[e]);
  }
}

// Which keys a CTA reads: positions [begin, end), and under block-sparse attention those whose
// sparse block some row of the tile sees (any head of the group, from the earliest query's block:
// a superset of what each row keeps, which the logits' mask then narrows).
struct TileKeys {
  int begin, end;
  bool sparse;
  int first_q_block, first_head, group;
  const Features* f;

  PAGED_DEVICE bool needed(int key) const {
    if (key < begin || key >= end) return false;
    if (!sparse) return true;
    const int k_block = key / f->bs_block_size;
    if (k_block > first_q_block - f->bs_local_blocks) return true;
    for (int h = 0; h < group; ++h) {
      const int head = first_head + h;
      const int offset = f->bs_head_sliding_step >= 0 ? head * f->bs_head_sliding_step + 1
                                                      : (first_head / group) * -f->bs_head_sliding_step + 1;
      if ((k_block + offset) % f->bs_vert_stride == 0) return true;
    }
    return false;
  }
};

// Grid (div_up(max_query_len * G, PREFILL_ROWS), num_kv_heads, num_seqs); PREFILL_THREADS threads;
// dynamic shared memory: the Q tile [PREFILL_ROWS][HEAD_SIZE + PAD], K tile [PREFILL_KEYS][HEAD_SIZE
// + PAD] and V tile [HEAD_SIZE][PREFILL_KEYS + PAD] in T (PAD = 16 bytes of T, against bank
// conflicts), then PREFILL_WARPS * 16 * PREFILL_KEYS floats of probabilities for the CUDA-core
// path. `out` is [num_tokens, num_heads, HEAD_SIZE]; query rows are `q_stride` elements apart.
template <typename T, typename CACHE_T, int HEAD_SIZE, int BLOCK_SIZE, bool FEATURES>
__global__ void prefill_attention_kernel(T* __restrict__ out, const T* __restrict__ q,
                                         const CACHE_T* __restrict__ k_cache, const CACHE_T* __restrict__ v_cache,
                                         int num_heads, int num_kv_heads, float scale,
                                         const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                                         const int* __restrict__ query_start_loc, int max_num_blocks_per_seq,
                                         int q_stride, int kv_block_stride, int kv_head_stride, int sliding_window,
                                         FEATURE_PARAMS) {
  constexpr bool FP8 = sizeof(CACHE_T) == 1;
  constexpr bool MMA = PAGED_HAS_MMA && sizeof(T) == 2;
  constexpr int X = 16 / sizeof(CACHE_T);             // K cache elements per 16-byte chunk
  constexpr int QV = 16 / sizeof(T);                  // query elements per 16-byte vector
  constexpr int VV = cmin(16 / static_cast<int>(sizeof(CACHE_T)), 8);  // V cache keys per vector load
  constexpr int ROW = HEAD_SIZE + QV;
  constexpr int VROW = PREFILL_KEYS + QV;
  constexpr int NT = PREFILL_KEYS / 8;  // 8-key column tiles of S
  constexpr int DT = HEAD_SIZE / 8;     // 8-dim column tiles of O
  static_assert(HEAD_SIZE % 16 == 0, "tensor-core k-steps of 16 head dims");
  static_assert(BLOCK_SIZE % VV == 0 && PREFILL_KEYS % VV == 0, "a V vector never straddles a cache block");
  const float neg_inf = negative_infinity();

  const int group = num_heads / num_kv_heads;
  const int kv_head = blockIdx.y, seq = blockIdx.z;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int num_rows = q_len * group;
  const int row0 = blockIdx.x * PREFILL_ROWS;
  if (row0 >= num_rows) return;
  const int seq_len = seq_lens[seq];
  const int context = seq_len - q_len;  // position of the sequence's first query
  const int last_row = cmin(row0 + PREFILL_ROWS, num_rows) - 1;
  const int first_pos = context + row0 / group;
  const int* block_table = block_tables + static_cast<int64>(seq) * max_num_blocks_per_seq;
  const Features f = FEATURE_ARGS;
  const bool sparse = FEATURES && f.bs_vert_stride > 0;
  const TileKeys keys{window_start(first_pos + 1, sliding_window), context + last_row / group + 1, sparse,
                      sparse ? first_pos / f.bs_block_size : 0, kv_head * group, group, &f};
  const float qk_scale = scale * (FP8 ? k_scales[kv_head] : 1.f);
  const float v_scale = FP8 ? v_scales[kv_head] : 1.f;
  const CACHE_T* k_head = k_cache + static_cast<int64>(kv_head) * kv_head_stride;
  const CACHE_T* v_head = v_cache + static_cast<int64>(kv_head) * kv_head_stride;

  T* q_s = reinterpret_cast<T*>(dynamic_smem());
  T* k_s = q_s + PREFILL_ROWS * ROW;
  T* v_s = k_s + PREFILL_KEYS * ROW;
  float* p_s = reinterpret_cast<float*>(v_s + HEAD_SIZE * VROW);

  for (int i = threadIdx.x; i < PREFILL_ROWS * (HEAD_SIZE / QV); i += PREFILL_THREADS) {
    const int r = i / (HEAD_SIZE / QV), c = i % (HEAD_SIZE / QV) * QV;
    const int row = row0 + r;
    Vec<T, QV> v;
    if (row < num_rows) {
      const int head = kv_head * group + row % group;
      v = load_vec<T, QV>(q + static_cast<int64>(q_start + row / group) * q_stride + head * HEAD_SIZE + c);
    } else {
#pragma unroll
      for (int e = 0; e < QV; ++e) v.val[e] = from_float<T>(0.f);
    }
    *reinterpret_cast<Vec<T, QV>*>(q_s + r * ROW + c) = v;
  }

  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int g = lane / 4, t = lane % 4;
  // This lane's two rows, g and g + 8 of its warp's 16: position, head and what they attend to.
  int pos[2], first_key[2], sparse_offset[2], q_block[2];
  bool live[2];
  float slope[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + warp * 16 + g + 8 * h;
    live[h] = row < num_rows;
    const int r = live[h] ? row : last_row;  // a padding row attends like a live one and is not written
    const int head = kv_head * group + r % group;
    pos[h] = context + r / group;
    first_key[h] = window_start(pos[h] + 1, sliding_window);
    slope[h] = FEATURES && f.alibi_slopes ? f.alibi_slopes[head] : 0.f;
    sparse_offset[h] = f.bs_head_sliding_step >= 0 ? head * f.bs_head_sliding_step + 1
                                                   : kv_head * -f.bs_head_sliding_step + 1;
    q_block[h] = sparse ? pos[h] / f.bs_block_size : 0;
  }

  float o[DT][4];
#pragma unroll
  for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float m[2] = {neg_inf, neg_inf}, l[2] = {0.f, 0.f};
  const T* q_w = q_s + warp * 16 * ROW;

  for (int n0 = keys.begin / PREFILL_KEYS * PREFILL_KEYS; n0 < keys.end; n0 += PREFILL_KEYS) {
    // The previous tile's K and V are consumed (and, the first time, the Q tile is complete).
    __syncthreads();
    for (int i = threadIdx.x; i < PREFILL_KEYS * (HEAD_SIZE / X); i += PREFILL_THREADS) {
      const int key = i / (HEAD_SIZE / X), chunk = i % (HEAD_SIZE / X);
      const int position = n0 + key;
      T* dst = k_s + key * ROW + chunk * X;
      if (keys.needed(position)) {
        const int64 block = block_table[position / BLOCK_SIZE];
        const Vec<CACHE_T, X> v = load_vec<CACHE_T, X>(k_head + block * kv_block_stride +
                                                        (chunk * BLOCK_SIZE + position % BLOCK_SIZE) * X);
        store_tile<T>(dst, v);
      } else {
#pragma unroll
        for (int e = 0; e < X; ++e) dst[e] = from_float<T>(0.f);
      }
    }
    for (int i = threadIdx.x; i < HEAD_SIZE * (PREFILL_KEYS / VV); i += PREFILL_THREADS) {
      const int dim = i / (PREFILL_KEYS / VV), first = i % (PREFILL_KEYS / VV) * VV;
      const int position = n0 + first;
      T* dst = v_s + dim * VROW + first;
      // A vector lies in one cache block and one sparse block (a multiple of the cache block).
      if (keys.needed(position) && keys.needed(position + VV - 1)) {
        const int64 block = block_table[position / BLOCK_SIZE];
        store_tile<T>(dst, load_vec<CACHE_T, VV>(v_head + block * kv_block_stride + dim * BLOCK_SIZE +
                                                  position % BLOCK_SIZE));
      } else {
        for (int e = 0; e < VV; ++e) {
          const int p = position + e;
          dst[e] = keys.needed(p)
                       ? cache_to<T>(v_head[block_table[p / BLOCK_SIZE] * static_cast<int64>(kv_block_stride) +
                                            dim * BLOCK_SIZE + p % BLOCK_SIZE])
                       : from_float<T>(0.f);
        }
      }
    }
    __syncthreads();

    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    if constexpr (MMA) {
#pragma unroll
      for (int kk = 0; kk < HEAD_SIZE; kk += 16) {
        const unsigned a[4] = {load2(q_w + g * ROW + kk + 2 * t), load2(q_w + (g + 8) * ROW + kk + 2 * t),
                               load2(q_w + g * ROW + kk + 8 + 2 * t), load2(q_w + (g + 8) * ROW + kk + 8 + 2 * t)};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const T* k_row = k_s + (n * 8 + g) * ROW + kk;
          const unsigned b[2] = {load2(k_row + 2 * t), load2(k_row + 8 + 2 * t)};
          mma_16816<T>(s[n], a, b);
        }
      }
    } else {
      // The same fragments on CUDA cores: each Q and K element read once per lane and tile.
      const T* q_rows = q_w + g * ROW;
#pragma unroll 4
      for (int d = 0; d < HEAD_SIZE; ++d) {
        const float q0 = to_float(q_rows[d]), q1 = to_float(q_rows[8 * ROW + d]);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const float k0 = to_float(k_s[(n * 8 + 2 * t) * ROW + d]), k1 = to_float(k_s[(n * 8 + 2 * t + 1) * ROW + d]);
          s[n][0] += q0 * k0;
          s[n][1] += q0 * k1;
          s[n][2] += q1 * k0;
          s[n][3] += q1 * k1;
        }
      }
    }

    // Scale, bias and mask; the tile's maximum of each row over its four lanes.
    float tile_max[2] = {neg_inf, neg_inf};
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int h = c / 2, key = n0 + n * 8 + 2 * t + c % 2;
        bool keep = key <= pos[h] && key >= first_key[h];
        if (sparse) keep = keep && sparse_keeps(f, key, q_block[h], sparse_offset[h]);
        float logit = s[n][c] * qk_scale;
        if (FEATURES) logit += slope[h] * static_cast<float>(key - pos[h]);
        s[n][c] = keep ? logit : neg_inf;
        tile_max[h] = fmaxf(tile_max[h], s[n][c]);
      }
    }
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(FULL_MASK, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(FULL_MASK, tile_max[h], 2));
      const float m_new = fmaxf(m[h], tile_max[h]);
      // A row with nothing visible yet keeps exp(-inf - 0) = 0 everywhere instead of NaN.
      base[h] = m_new == neg_inf ? 0.f : m_new;
      const float alpha = __expf(m[h] - base[h]);
      m[h] = m_new;
      l[h] *= alpha;
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        o[d][2 * h] *= alpha;
        o[d][2 * h + 1] *= alpha;
      }
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[n][c] = __expf(s[n][c] - base[c / 2]);
        l[c / 2] += s[n][c];
      }
    }

    if constexpr (MMA) {
#pragma unroll
      for (int kk = 0; kk < PREFILL_KEYS / 16; ++kk) {
        const unsigned a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                               pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int d = 0; d < DT; ++d) {
          const T* v_row = v_s + (d * 8 + g) * VROW + kk * 16;
          const unsigned b[2] = {load2(v_row + 2 * t), load2(v_row + 8 + 2 * t)};
          mma_16816<T>(o[d], a, b);
        }
      }
    } else {
      float* p_w = p_s + warp * 16 * PREFILL_KEYS;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) p_w[(g + 8 * (c / 2)) * PREFILL_KEYS + n * 8 + 2 * t + c % 2] = s[n][c];
      }
      __syncwarp();
      const float* p_rows = p_w + g * PREFILL_KEYS;
#pragma unroll 2
      for (int k = 0; k < PREFILL_KEYS; ++k) {
        const float p0 = p_rows[k], p1 = p_rows[8 * PREFILL_KEYS + k];
#pragma unroll
        for (int d = 0; d < DT; ++d) {
          const float v0 = to_float(v_s[(d * 8 + 2 * t) * VROW + k]), v1 = to_float(v_s[(d * 8 + 2 * t + 1) * VROW + k]);
          o[d][0] += p0 * v0;
          o[d][1] += p0 * v1;
          o[d][2] += p1 * v0;
          o[d][3] += p1 * v1;
        }
      }
      // The next tile's probabilities overwrite these only after every lane has read them.
      __syncwarp();
    }
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
    l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
    if (!live[h]) continue;
    const int row = row0 + warp * 16 + g + 8 * h;
    const float inv = v_scale / l[h];  // the row's own key is always visible, so l >= exp(0) = 1
    T* out_row = out + (static_cast<int64>(q_start + row / group) * num_heads + kv_head * group + row % group) *
                           HEAD_SIZE;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      out_row[d * 8 + 2 * t] = from_float<T>(o[d][2 * h] * inv);
      out_row[d * 8 + 2 * t + 1] = from_float<T>(o[d][2 * h + 1] * inv);
    }
  }
}

}  // namespace paged
