// Decode attention v3: GQA-grouped, single-pass, split-KV (kernel.version=v3).
//
// v1/v2 give each query head its own CTA, so the G heads of a GQA group each read their KV head
// from memory (G times the traffic and the fp8 conversion), and read K and V in two dependent
// passes. v3's CTA owns one (sequence, KV head, KV split) and up to GT heads of the group (all of
// them for G <= 8; larger groups take several head chunks), so every K/V byte of the split is read
// once for them. The split's keys go through shared memory in tiles of V3_TILE keys, loaded with
// 16-byte cp.async in a STAGES-deep pipeline (tile i + STAGES - 1 is in flight while tile i is
// computed; the host picks STAGES per device and cache, paged/kernels/v3_layout.py: as deep as the
// shared memory allows without costing an SM a CTA, so fp8 and small heads keep as many bytes in
// flight as 16-bit head-128 tiles do); the block-table entries of the next V3_TABLE_CHUNK blocks are prefetched into
// shared memory, so no tile waits on a table read before its loads can start. One pass with an
// online softmax: each warp owns 8 keys of every tile and keeps a running max, sum and fp32 output
// per head; the warps are merged at the end.
//
// The products. fp16 and bf16 models with a head tile of 4 or 8 (GQA groups >= 3; 4 query heads
// and up) on sm_80 and newer run both on tensor cores (mma.cuh's m16n8k16, fp32 accumulation),
// with the heads as the M dimension and the warp's 8 keys as N: S = Q·Kᵀ takes A = the CTA's query
// heads (rows 0..GT-1 of 16, the rest zero; the unscaled query in T, so it is exact) and B = the
// keys' head dims straight from the K tile (fp8 converted to T exactly: its raw half value, via
// float for bf16), HEAD / 16 instructions; the softmax scale (with k_scale) multiplies the fp32
// logits. Each lane then holds head lane / 4's logits of keys 2t, 2t+1 (t = lane % 4), so the
// softmax state of a head lives in its four lanes (max over them by two shuffles, the sum kept per
// lane until the end). O = P·V takes those probabilities, rounded to T as flash-attention does
// (the sum adds the rounded values, so the weights stay normalised), as the A fragment without
// leaving registers (keys 8..15 of the k16 step zero) and B = V's keys 2t, 2t+1 of head dim
// 8n + lane / 4, HEAD / 8 instructions, the output of head lane / 4 at dims 8n + 2t, 2t + 1.
// Half of each instruction is padding (rows 8..15 and, in P·V, keys 8..15), which costs nothing
// that matters next to the CUDA-core loops it replaces. Masked keys are zeroed in V's fragment
// (their logits are -inf by selection, and a NaN in a K slot only reaches its own key's logit).
// fp32 models, head tiles of 1 and 2, and targets before sm_80 compute on CUDA cores: 4 lanes per
// key share its head dims for S, and each lane owns head dims of P·V for every head.
//
// Splits (paged/kernels/split_plan.py, planned once per step from the SM count and occupancy):
// split s covers split_blocks cache blocks from the block holding the first position the query
// attends to. With one split the CTA writes the output; with several each writes its normalised
// partial output and log-sum-exp, and the merge kernel weights them by exp(lse - max). Splits past
// a sequence's end return at once, and a split index past the scratch's capacity never writes.
//
// The features are v1/v2's (attention.cuh): a sliding window (blocks before it never read, the
// first block's earlier slots masked), ALiBi, block-sparse (blocks no head of the CTA sees are not
// loaded; a head that does not see a loaded block gets -inf logits there) and fp8 caches, converted
// four bytes at a time (fp8_vec.cuh) with k_scale folded into the query and v_scale into the final
// normalisation. Masked slots are excluded by selection, so NaN in unwritten cache memory never
// reaches the output.
#pragma once

#include "async_copy.cuh"
#include "attention.cuh"
#include "mma.cuh"

namespace paged {

constexpr int V3_WARPS = 4;
constexpr int V3_THREADS = V3_WARPS * WARP_SIZE;
constexpr int V3_TILE = 32;                          // keys per K/V tile (split_plan.py's TILE_TOKENS)
constexpr int V3_WARP_KEYS = V3_TILE / V3_WARPS;     // keys of a tile each warp owns
constexpr int V3_SLICES = WARP_SIZE / V3_WARP_KEYS;  // lanes sharing one key's head dims
constexpr int V3_TABLE_CHUNK = 128;                  // block-table entries prefetched at a time

// The shared memory of one CTA (paged/kernels/v3_layout.py computes the same bytes).
template <typename CACHE_T, int HEAD, int GT, int STAGES>
struct V3Layout {
  static_assert(STAGES >= 2, "one tile computed while the next loads");
  static constexpr int TILE_BYTES = V3_TILE * HEAD * static_cast<int>(sizeof(CACHE_T));  // K or V
  static constexpr int Q_BYTES = GT * HEAD * 4;  // the query: fp32, pre-scaled (T, unscaled, for tensor cores)
  static constexpr int TABLE_BYTES = V3_TABLE_CHUNK * 4;
  static constexpr int P_BYTES = V3_WARPS * GT * V3_WARP_KEYS * 4;  // each warp's probabilities
  static constexpr int STATE_BYTES = 2 * V3_WARPS * GT * 4;         // each warp's max and sum
  static constexpr int STAGE_OFFSET = Q_BYTES + TABLE_BYTES + P_BYTES + STATE_BYTES;
  static constexpr int BYTES = STAGE_OFFSET + STAGES * 2 * TILE_BYTES;
  static_assert(STAGE_OFFSET % 16 == 0, "cp.async needs 16-byte aligned tiles");
  // The warps' outputs are merged through the tiles' memory once the pipeline has drained.
  static_assert(V3_WARPS * GT * HEAD * 4 <= STAGES * 2 * TILE_BYTES, "the merge fits in the tiles");
};

// Eight consecutive cache elements as floats (fp8 ones raw, see fp8_vec.cuh).
template <typename C>
PAGED_DEVICE void load_floats8(const C* src, float (&out)[8]) {
  if constexpr (sizeof(C) == 4) {
    const Vec<C, 4> lo = load_vec<C, 4>(src), hi = load_vec<C, 4>(src + 4);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      out[e] = to_float(lo.val[e]);
      out[e + 4] = to_float(hi.val[e]);
    }
  } else {
    to_floats(load_vec<C, 8>(src), out);
  }
}

// Grid (num_kv_heads * head chunks, num_seqs, splits), V3_THREADS threads, V3Layout::BYTES of
// dynamic shared memory for a STAGES-deep K/V pipeline. lse [num_seqs, num_heads, scratch_splits]
// and tmp_out [..., HEAD] are written only with more than one split.
template <typename T, typename CACHE_T, int HEAD, int BLOCK, int GT, int STAGES, bool FEATURES>
__global__ void paged_attention_v3_kernel(T* __restrict__ out, float* __restrict__ lse, float* __restrict__ tmp_out,
                                          const T* __restrict__ q, const CACHE_T* __restrict__ k_cache,
                                          const CACHE_T* __restrict__ v_cache, int num_heads, int num_kv_heads,
                                          float scale, const int* __restrict__ block_tables,
                                          const int* __restrict__ seq_lens, int max_num_blocks_per_seq,
                                          int q_stride, int kv_block_stride, int kv_head_stride, int sliding_window,
                                          int split_blocks, int scratch_splits, FEATURE_PARAMS) {
  typedef V3Layout<CACHE_T, HEAD, GT, STAGES> L;
  // Tensor cores (see the top of the file); the fragments read the cache as T pairs or fp8.
  constexpr bool MMA = PAGED_HAS_MMA && sizeof(T) == 2 && GT >= 4 && GT <= 8 && HEAD % 16 == 0 &&
                       (SameType<T, CACHE_T>::value || sizeof(CACHE_T) == 1);
  constexpr int X = 16 / sizeof(CACHE_T);
  constexpr int TILE_BLOCKS = V3_TILE / BLOCK;
  constexpr int ROWS = div_up(HEAD, WARP_SIZE);  // head dims per lane in P·V
  constexpr int PIECES = HEAD * BLOCK * static_cast<int>(sizeof(CACHE_T)) / 16;  // 16 B pieces of a block
  static_assert(V3_TILE % BLOCK == 0 && BLOCK % V3_WARP_KEYS == 0, "a warp's keys lie in one cache block");
  static_assert(V3_TABLE_CHUNK % TILE_BLOCKS == 0, "a tile's table entries lie in one prefetched chunk");
  const Features f = FEATURE_ARGS;

  const int thread = threadIdx.x, warp = thread / WARP_SIZE, lane = thread % WARP_SIZE;
  const int group = num_heads / num_kv_heads;
  const int chunks = div_up(group, GT);
  const int kv_head = blockIdx.x / chunks;
  const int head0 = kv_head * group + (blockIdx.x % chunks) * GT;
  const int heads = cmin(GT, kv_head * group + group - head0);
  const int seq = blockIdx.y, split = blockIdx.z;
  const int seq_len = seq_lens[seq];
  const int first_token = window_start(seq_len, sliding_window);
  const int num_seq_blocks = div_up(seq_len, BLOCK);
  const int start_block = first_token / BLOCK + split * split_blocks;
#ifdef PAGED_TEST_NO_SPLIT_GUARD
  const bool past_scratch = false;  // the planted defect: splits past the scratch write past it
#else
  const bool past_scratch = split >= scratch_splits;
#endif
  // Split 0 always runs, so an empty sequence still gets its (zero) output.
  if ((split > 0 && start_block >= num_seq_blocks) || past_scratch) return;
  const int end_block = cmin(start_block + split_blocks, num_seq_blocks);
  const int num_tiles = cmax(div_up(end_block - start_block, TILE_BLOCKS), 0);
  const int* block_table = block_tables + static_cast<int64>(seq) * max_num_blocks_per_seq;
  const bool fp8 = sizeof(CACHE_T) == 1;
  const float k_scale = fp8 ? f.k_scales[kv_head] * raw_scale<CACHE_T>() : 1.f;
  const float v_scale = fp8 ? f.v_scales[kv_head] * raw_scale<CACHE_T>() : 1.f;
  const bool sparse = FEATURES && f.bs_vert_stride > 0;
  const int q_sparse_block = sparse ? (seq_len - 1) / f.bs_block_size : 0;

  char* smem = dynamic_smem();
  float* q_s = reinterpret_cast<float*>(smem);
  int* table_s = reinterpret_cast<int*>(smem + L::Q_BYTES);
  float* p_s = reinterpret_cast<float*>(smem + L::Q_BYTES + L::TABLE_BYTES) + warp * GT * V3_WARP_KEYS;
  float* max_s = reinterpret_cast<float*>(smem + L::Q_BYTES + L::TABLE_BYTES + L::P_BYTES);
  float* sum_s = max_s + V3_WARPS * GT;
  CACHE_T* tiles = reinterpret_cast<CACHE_T*>(smem + L::STAGE_OFFSET);

  float slope[GT];
  int sparse_offset[GT];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    const int head = head0 + cmin(g, heads - 1);
    slope[g] = FEATURES && f.alibi_slopes ? f.alibi_slopes[head] : 0.f;
    sparse_offset[g] = f.bs_head_sliding_step >= 0 ? head * f.bs_head_sliding_step + 1
                                                   : kv_head * -f.bs_head_sliding_step + 1;
  }
  // Whether head g of the CTA attends to the cache block starting at `token` (block-sparse).
  auto sees = [&](int g, int token) {
    return !sparse || (g < heads && sparse_keeps(f, token, q_sparse_block, sparse_offset[g]));
  };
  auto any_sees = [&](int token) {
    bool any = false;
#pragma unroll
    for (int g = 0; g < GT; ++g) any = any || sees(g, token);
    return any;
  };

  const float q_scale = scale * k_scale;
  const T* q_ptr = q + static_cast<int64>(seq) * q_stride + static_cast<int64>(head0) * HEAD;
  if constexpr (MMA) {
    T* q_t = reinterpret_cast<T*>(smem);
    for (int i = thread; i < GT * HEAD; i += V3_THREADS) q_t[i] = i < heads * HEAD ? q_ptr[i] : from_float<T>(0.f);
  } else {
    for (int i = thread; i < GT * HEAD; i += V3_THREADS) {
      q_s[i] = i < heads * HEAD ? to_float(q_ptr[i]) * q_scale : 0.f;
    }
  }

  // Issues the copies of tile j (if the split has it) into its stage and closes a commit group, so
  // every thread counts the same groups.
  auto issue = [&](int j) {
    if (j < num_tiles) {
      const int rel = j * TILE_BLOCKS;
      if (rel % V3_TABLE_CHUNK == 0) {
        __syncthreads();  // no thread still reads the previous chunk's entries
        const int block = start_block + rel + thread;
        if (thread < V3_TABLE_CHUNK) table_s[thread] = block < end_block ? block_table[block] : 0;
        __syncthreads();
      }
      char* stage = reinterpret_cast<char*>(tiles + (j % STAGES) * 2 * V3_TILE * HEAD);
#pragma unroll
      for (int b = 0; b < TILE_BLOCKS; ++b) {
        const int block = start_block + rel + b;
        if (block < end_block && any_sees(block * BLOCK)) {
          const int64 offset = static_cast<int64>(table_s[(rel + b) % V3_TABLE_CHUNK]) * kv_block_stride +
                               static_cast<int64>(kv_head) * kv_head_stride;
          const char* k_src = reinterpret_cast<const char*>(k_cache + offset);
          const char* v_src = reinterpret_cast<const char*>(v_cache + offset);
          char* k_dst = stage + b * HEAD * BLOCK * static_cast<int>(sizeof(CACHE_T));
          char* v_dst = k_dst + L::TILE_BYTES;
          for (int i = thread; i < PIECES; i += V3_THREADS) {
            cp_async16(k_dst + 16 * i, k_src + 16 * i);
            cp_async16(v_dst + 16 * i, v_src + 16 * i);
          }
        }
      }
    }
    cp_async_commit();
  };

  const float neg_inf = negative_infinity();
  float* outputs = reinterpret_cast<float*>(tiles);
  // The K/V pipeline around a warp's `compute(j)` of tile j; the tiles' memory is free afterwards.
  auto pipeline = [&](auto&& compute) {
    for (int j = 0; j < STAGES - 1; ++j) issue(j);
    for (int j = 0; j < num_tiles; ++j) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile j is in every thread's view; tile j - 1's stage is free again
      issue(j + STAGES - 1);
      compute(j);
    }
    cp_async_wait<0>();
    __syncthreads();
  };

  if constexpr (MMA) {
    // Lane (g, t) = (lane / 4, lane % 4): head g of the tile (rows g + 8 are padding) and, of the
    // warp's 8 keys, 2t and 2t + 1 in S and P; head dims 8n + 2t, 8n + 2t + 1 of O.
    const int g = lane / 4, t = lane % 4;
    const bool g_live = g < GT;
    const int my_head = head0 + cmin(g, heads - 1);
    const float my_slope = FEATURES && f.alibi_slopes ? f.alibi_slopes[my_head] : 0.f;
    const int my_offset = f.bs_head_sliding_step >= 0 ? my_head * f.bs_head_sliding_step + 1
                                                      : kv_head * -f.bs_head_sliding_step + 1;
    const T* q_g = reinterpret_cast<const T*>(smem) + cmin(g, GT - 1) * HEAD;
    float m_run = neg_inf, l_run = 0.f, o[HEAD / 8][2];
#pragma unroll
    for (int n = 0; n < HEAD / 8; ++n) o[n][0] = o[n][1] = 0.f;

    auto compute = [&](int j) {
      const int in_tile = warp * V3_WARP_KEYS;
      const int block = start_block + j * TILE_BLOCKS + in_tile / BLOCK;
      if (block >= end_block || !any_sees(block * BLOCK)) return;
      const int slot = in_tile % BLOCK;  // the warp's first key in its cache block
      const int first_key = block * BLOCK + slot;
      const CACHE_T* k_tile = tiles + (j % STAGES) * 2 * V3_TILE * HEAD + (in_tile / BLOCK) * HEAD * BLOCK;
      const CACHE_T* v_tile = k_tile + V3_TILE * HEAD;

      // S = Q·Kᵀ: K's layout [HEAD / X][BLOCK][X] puts head dims 2t, 2t + 1 of key g side by side.
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < HEAD; kk += 16) {
        const unsigned a[4] = {g_live ? load2(q_g + kk + 2 * t) : 0u, 0u, g_live ? load2(q_g + kk + 8 + 2 * t) : 0u,
                               0u};
        unsigned b[2];
        if constexpr (sizeof(CACHE_T) == 1) {
          // One 16-byte chunk per key holds the k-step: bytes 2t, 2t + 1 and 8 + 2t, 9 + 2t.
          const unsigned short* chunk =
              reinterpret_cast<const unsigned short*>(k_tile + ((kk / X) * BLOCK + slot + g) * X);
          unsigned halves[2];
          fp8x4_to_half2x2<CACHE_T>(static_cast<unsigned>(chunk[t]) | static_cast<unsigned>(chunk[4 + t]) << 16,
                                    halves);
          b[0] = half2_to<T>(halves[0]);
          b[1] = half2_to<T>(halves[1]);
        } else {
          b[0] = load2(k_tile + ((kk / X) * BLOCK + slot + g) * X + 2 * t);
          b[1] = load2(k_tile + ((kk / X + 1) * BLOCK + slot + g) * X + 2 * t);
        }
        mma_16816<T>(s, a, b);
      }

      // Scale, bias and mask by selection; the online softmax over the head's four lanes.
      const bool head_sees = g_live && (!sparse || (g < heads && sparse_keeps(f, block * BLOCK, q_sparse_block,
                                                                               my_offset)));
      bool valid[2];
      float tile_max = neg_inf;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int token = first_key + 2 * t + c;
        valid[c] = token >= first_token && token < seq_len;
        s[c] = valid[c] && head_sees ? s[c] * q_scale + my_slope * (token - seq_len + 1) : neg_inf;
        tile_max = fmaxf(tile_max, s[c]);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 2));
      const float new_max = fmaxf(m_run, tile_max);
      // Nothing seen yet: keep the state as it is (exp(-inf - -inf) would be NaN).
      const bool none = new_max == neg_inf;
      const float alpha = none ? 1.f : __expf(m_run - new_max);
      m_run = new_max;
      const unsigned p_pair = pack2<T>(none ? 0.f : __expf(s[0] - new_max), none ? 0.f : __expf(s[1] - new_max));
      const T* p_t = reinterpret_cast<const T*>(&p_pair);
      l_run = l_run * alpha + (to_float(p_t[0]) + to_float(p_t[1]));

      // O += P·V, masked keys' V zeroed (unwritten slots may hold NaN, and 0 · NaN is NaN).
      const unsigned a[4] = {p_pair, 0u, 0u, 0u};
      const unsigned keep = (valid[0] ? 0x0000ffffu : 0u) | (valid[1] ? 0xffff0000u : 0u);
#pragma unroll
      for (int n = 0; n < HEAD / 8; ++n) {
        const unsigned b[2] = {fragment_pair<T>(v_tile + (n * 8 + g) * BLOCK + slot + 2 * t) & keep, 0u};
        float d[4] = {o[n][0] * alpha, o[n][1] * alpha, 0.f, 0.f};
        mma_16816<T>(d, a, b);
        o[n][0] = d[0];
        o[n][1] = d[1];
      }
    };
    pipeline(compute);

    // Merge the warps: each rescales its output to the CTA's max and leaves it in the tiles' memory.
    l_run += __shfl_xor_sync(FULL_MASK, l_run, 1);
    l_run += __shfl_xor_sync(FULL_MASK, l_run, 2);
    if (g_live && t == 0) {
      max_s[warp * GT + g] = m_run;
      sum_s[warp * GT + g] = l_run;
    }
    __syncthreads();
    if (g_live) {
      float cta_max = neg_inf;
#pragma unroll
      for (int w = 0; w < V3_WARPS; ++w) cta_max = fmaxf(cta_max, max_s[w * GT + g]);
      const float factor = m_run == neg_inf ? 0.f : __expf(m_run - cta_max);
#pragma unroll
      for (int n = 0; n < HEAD / 8; ++n) {
        outputs[(warp * GT + g) * HEAD + n * 8 + 2 * t] = o[n][0] * factor;
        outputs[(warp * GT + g) * HEAD + n * 8 + 2 * t + 1] = o[n][1] * factor;
      }
    }
  } else {
    float row_max[GT], row_sum[GT], acc[GT][ROWS];
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      row_max[g] = neg_inf;
      row_sum[g] = 0.f;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[g][r] = 0.f;
    }
    const int slice = lane / V3_WARP_KEYS, key = lane % V3_WARP_KEYS;

    // One warp's 8 keys of tile j: logits, the online softmax update and P·V.
    auto compute = [&](int j) {
      const int in_tile = warp * V3_WARP_KEYS;
      const int block = start_block + j * TILE_BLOCKS + in_tile / BLOCK;
      if (block >= end_block || !any_sees(block * BLOCK)) return;
      const int first_key = block * BLOCK + in_tile % BLOCK;
      const CACHE_T* k_tile = tiles + (j % STAGES) * 2 * V3_TILE * HEAD + (in_tile / BLOCK) * HEAD * BLOCK;
      const CACHE_T* v_tile = k_tile + V3_TILE * HEAD;

      float dot[GT];
#pragma unroll
      for (int g = 0; g < GT; ++g) dot[g] = 0.f;
      for (int c = slice; c < HEAD / X; c += V3_SLICES) {
        float k[X];
        to_floats(load_vec<CACHE_T, X>(k_tile + (c * BLOCK + in_tile % BLOCK + key) * X), k);
#pragma unroll
        for (int g = 0; g < GT; ++g) {
          const float* qg = q_s + g * HEAD + c * X;
#pragma unroll
          for (int e = 0; e < X; ++e) dot[g] += qg[e] * k[e];
        }
      }
      // The four slices of a key hold partial dot products over disjoint head dims.
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        dot[g] += __shfl_xor_sync(FULL_MASK, dot[g], V3_WARP_KEYS);
        dot[g] += __shfl_xor_sync(FULL_MASK, dot[g], 2 * V3_WARP_KEYS);
      }
      const int token = first_key + key;
      const bool valid = token >= first_token && token < seq_len;
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        const float logit = valid && sees(g, block * BLOCK) ? dot[g] + slope[g] * (token - seq_len + 1) : neg_inf;
        const float tile_max = warp_reduce<V3_WARP_KEYS / 2>(logit, MaxOp());
        const float new_max = fmaxf(row_max[g], tile_max);
        // Nothing seen yet: keep the state as it is (exp(-inf - -inf) would be NaN).
        const bool none = new_max == neg_inf;
        const float p = none ? 0.f : __expf(logit - new_max);
        const float alpha = none ? 1.f : __expf(row_max[g] - new_max);
        row_sum[g] = row_sum[g] * alpha + warp_reduce<V3_WARP_KEYS / 2>(p, SumOp());
        row_max[g] = new_max;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[g][r] *= alpha;
        if (slice == 0) p_s[g * V3_WARP_KEYS + key] = p;
      }
      __syncwarp();
      bool slot_valid[V3_WARP_KEYS];
#pragma unroll
      for (int e = 0; e < V3_WARP_KEYS; ++e) slot_valid[e] = first_key + e >= first_token && first_key + e < seq_len;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int d = lane + r * WARP_SIZE;
        if (d < HEAD) {
          float v[V3_WARP_KEYS];
          load_floats8(v_tile + d * BLOCK + in_tile % BLOCK, v);
#pragma unroll
          for (int e = 0; e < V3_WARP_KEYS; ++e) v[e] = slot_valid[e] ? v[e] : 0.f;
#pragma unroll
          for (int g = 0; g < GT; ++g) {
            float sum = 0.f;
#pragma unroll
            for (int e = 0; e < V3_WARP_KEYS; ++e) sum += p_s[g * V3_WARP_KEYS + e] * v[e];
            acc[g][r] += sum;
          }
        }
      }
      __syncwarp();  // the probabilities are read before the next tile overwrites them
    };

    pipeline(compute);

    // Merge the warps: each rescales its output to the CTA's max and leaves it in the tiles' memory.
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        max_s[warp * GT + g] = row_max[g];
        sum_s[warp * GT + g] = row_sum[g];
      }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float cta_max = neg_inf;
#pragma unroll
      for (int w = 0; w < V3_WARPS; ++w) cta_max = fmaxf(cta_max, max_s[w * GT + g]);
      const float factor = row_max[g] == neg_inf ? 0.f : __expf(row_max[g] - cta_max);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int d = lane + r * WARP_SIZE;
        if (d < HEAD) outputs[(warp * GT + g) * HEAD + d] = acc[g][r] * factor;
      }
    }
  }
  __syncthreads();
  const bool partial = gridDim.z > 1;
  for (int i = thread; i < heads * HEAD; i += V3_THREADS) {
    const int g = i / HEAD, d = i % HEAD;
    float cta_max = neg_inf, cta_sum = 0.f, value = 0.f;
#pragma unroll
    for (int w = 0; w < V3_WARPS; ++w) cta_max = fmaxf(cta_max, max_s[w * GT + g]);
#pragma unroll
    for (int w = 0; w < V3_WARPS; ++w) {
      const float m = max_s[w * GT + g];
      cta_sum += m == neg_inf ? 0.f : sum_s[w * GT + g] * __expf(m - cta_max);
      value += outputs[(w * GT + g) * HEAD + d];
    }
    // A split that sees nothing (block-sparse, or an empty sequence) has sum 0: output 0, weight 0.
    const float o = cta_sum > 0.f ? value / cta_sum * v_scale : 0.f;
    const int64 row = static_cast<int64>(seq) * num_heads + head0 + g;
    if (!partial) {
      out[row * HEAD + d] = from_float<T>(o);
    } else {
      tmp_out[(row * scratch_splits + split) * HEAD + d] = o;
      if (d == 0) lse[row * scratch_splits + split] = cta_sum > 0.f ? cta_max + logf(cta_sum) : neg_inf;
    }
  }
}

// Grid (num_heads, num_seqs), V3_THREADS threads: the splits of each row weighted by
// exp(lse - max lse), which rescales their normalised outputs to the row's softmax. Parallel over
// the splits as well as the head dims, so 128+ splits stay cheap: the threads form GROUPS groups of
// HEAD / 4 lanes, a lane owning 4 head dims (one 16-byte load); group r reads splits r, r + GROUPS,
// ..., so a thread walks splits / GROUPS of them (4 at a time in flight) instead of all, and the
// groups' sums meet in shared memory. The max is a block reduction over all threads.
template <typename T, int HEAD>
__global__ void paged_attention_v3_merge_kernel(T* __restrict__ out, const float* __restrict__ lse,
                                                const float* __restrict__ tmp_out, const int* __restrict__ seq_lens,
                                                int block_size, int split_blocks, int scratch_splits,
                                                int sliding_window) {
  constexpr int VEC = 4;
  constexpr int LANES = HEAD / VEC;
  constexpr int GROUPS = V3_THREADS / LANES;
  static_assert(HEAD % VEC == 0 && GROUPS >= 1, "a split's head dims are 16-byte pieces the block covers");
  __shared__ float red_smem[V3_WARPS];
  __shared__ float group_sums[GROUPS][HEAD];
  __shared__ float group_totals[GROUPS];
  const int head = blockIdx.x, seq = blockIdx.y, thread = threadIdx.x;
  const int seq_len = seq_lens[seq];
  const int attended_blocks = div_up(seq_len, block_size) - window_start(seq_len, sliding_window) / block_size;
  const int splits = cmin(cmax(div_up(attended_blocks, split_blocks), 1), scratch_splits);
  const int64 row = static_cast<int64>(seq) * gridDim.x + head;
  const float* row_lse = lse + row * scratch_splits;
  const float* row_out = tmp_out + row * scratch_splits * HEAD;
  const float neg_inf = negative_infinity();
  float max_lse = neg_inf;
  for (int s = thread; s < splits; s += V3_THREADS) max_lse = fmaxf(max_lse, row_lse[s]);
  max_lse = block_reduce<V3_WARPS>(red_smem, max_lse, neg_inf, MaxOp());

  const int group = thread / LANES, lane = thread % LANES;
  if (group < GROUPS) {
    float value[VEC] = {0.f, 0.f, 0.f, 0.f}, total = 0.f;
    if (max_lse != neg_inf) {
#pragma unroll 4
      for (int s = group; s < splits; s += GROUPS) {
        const float w = row_lse[s] == neg_inf ? 0.f : __expf(row_lse[s] - max_lse);
        const Vec<float, VEC> part = load_vec<float, VEC>(row_out + static_cast<int64>(s) * HEAD + lane * VEC);
        total += w;
#pragma unroll
        for (int e = 0; e < VEC; ++e) value[e] += w * part.val[e];
      }
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) group_sums[group][lane * VEC + e] = value[e];
    if (lane == 0) group_totals[group] = total;
  }
  __syncthreads();
  for (int d = thread; d < HEAD; d += V3_THREADS) {
    float value = 0.f, total = 0.f;
#pragma unroll
    for (int r = 0; r < GROUPS; ++r) {
      value += group_sums[r][d];
      total += group_totals[r];
    }
    out[row * HEAD + d] = from_float<T>(total > 0.f ? value / total : 0.f);
  }
}

}  // namespace paged
