// Paged attention for decode (one query token per sequence), after vLLM's kernel design.
//
// A block handles one (head, sequence[, partition]). Thread groups of GROUP threads share one
// key token and each thread reads 16-byte vectors of it from the
// [num_blocks, num_kv_heads, head_size/X, block_size, X] layout; warps stride over the sequence's
// blocks through its block table. Logits and softmax are fp32 in shared memory. For P·V each lane
// reads V_VEC consecutive tokens of a head-dim row, and warps are combined through shared memory.
// v1 covers the whole context in one block; v2 splits it into partitions (exp_sums, max_logits and
// a partial output per partition) that the reduce kernel rescales and sums.
//
// A sliding window W (0: none) limits the query, at position seq_len - 1, to positions from
// seq_len - W on. Table entries of blocks wholly before the window may name blocks the block
// manager freed and gave to other sequences, so they are never read: v1 starts at the window's
// first block, and v2 numbers its partitions from the window's first one (grid z and the scratch
// arrays cover only the partitions the window reaches); positions before the window inside that
// first block are masked.
//
// The cache's element type CACHE_T is T, or fp8 (__nv_fp8_e4m3 / __nv_fp8_e5m2) with one fp32
// scale per KV head: a key's dot product and a value row's weighted sum are taken on the fp8 values
// converted four at a time (fp8_vec.cuh) and multiplied by the head's scale once
// (x = 16 / sizeof(CACHE_T) = 16).
// ALiBi (alibi_slopes non-null) adds slope * (token - query position) to each logit. Block-sparse
// attention (bs_vert_stride > 0) keeps a cache block when its sparse block is among the query's
// bs_local_blocks last ones or a vertical one ((sparse block + offset) % bs_vert_stride == 0, the
// offset sliding with the head); other blocks are never read, their logits set to -FLT_MAX so
// their probability is 0 (a v2 partition with none left gets weight 0 in the reduce). Both are
// compiled in only where the kernels' FEATURES template argument is true: one kernel body holding
// both variants ran plain attention 2-3x slower on an H100 (v1).
#pragma once

#include "fp8_vec.cuh"

namespace paged {

// The first position the decode query attends to.
PAGED_DEVICE int window_start(int seq_len, int sliding_window) {
  return sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
}

// The optional features' arguments, the same for every kernel that attends.
struct Features {
  const float* k_scales;      // [num_kv_heads], read only for an fp8 cache
  const float* v_scales;
  const float* alibi_slopes;  // [num_heads] or null
  int bs_block_size;          // tokens per sparse block (a multiple of BLOCK_SIZE)
  int bs_local_blocks;
  int bs_vert_stride;         // 0: dense
  int bs_head_sliding_step;
};

// Kernels take the features as plain arguments (the launch paths pass pointers and ints only).
#define FEATURE_PARAMS                                                                                 \
  const float *__restrict__ k_scales, const float *__restrict__ v_scales,                              \
      const float *__restrict__ alibi_slopes, int bs_block_size, int bs_local_blocks, int bs_vert_stride, \
      int bs_head_sliding_step
#define FEATURE_ARGS                                                                                      \
  Features{k_scales, v_scales, alibi_slopes, bs_block_size, bs_local_blocks, bs_vert_stride, bs_head_sliding_step}

// Whether a query whose last position is in sparse block q_block attends to the cache block
// starting at token `block_start`.
PAGED_DEVICE bool sparse_keeps(const Features& f, int block_start, int q_block, int offset) {
  const int k_block = block_start / f.bs_block_size;
  return k_block > q_block - f.bs_local_blocks || (k_block + offset) % f.bs_vert_stride == 0;
}

template <typename T, typename CACHE_T, typename OUT_T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS,
          int PARTITION_SIZE, bool FEATURES>
PAGED_DEVICE void paged_attention(float* __restrict__ exp_sums, float* __restrict__ max_logits,
                                  OUT_T* __restrict__ out, const T* __restrict__ q,
                                  const CACHE_T* __restrict__ k_cache, const CACHE_T* __restrict__ v_cache,
                                  int num_kv_heads, float scale, const int* __restrict__ block_tables,
                                  const int* __restrict__ seq_lens, int max_num_blocks_per_seq,
                                  int q_stride, int kv_block_stride, int kv_head_stride, int sliding_window,
                                  const Features& f) {
  constexpr bool PARTITIONED = PARTITION_SIZE > 0;
  constexpr bool FP8 = sizeof(CACHE_T) == 1;
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  constexpr int X = 16 / sizeof(CACHE_T);
  constexpr int GROUP = cmax(WARP_SIZE / BLOCK_SIZE, 1);
  constexpr int NUM_GROUPS = NUM_THREADS / GROUP;
  constexpr int VEC = cmax(16 / (GROUP * static_cast<int>(sizeof(T))), 1);
  constexpr int VECS_PER_THREAD = HEAD_SIZE / (GROUP * VEC);
  constexpr int V_VEC = cmin(16 / static_cast<int>(sizeof(T)), BLOCK_SIZE);
  constexpr int V_VECS_PER_ROW = BLOCK_SIZE / V_VEC;
  constexpr int ROWS_PER_ITER = WARP_SIZE / V_VECS_PER_ROW;
  constexpr int ROWS_PER_THREAD = div_up(HEAD_SIZE, ROWS_PER_ITER);
  static_assert(BLOCK_SIZE <= WARP_SIZE && WARP_SIZE % BLOCK_SIZE == 0, "one warp covers one block");
  static_assert(HEAD_SIZE % (GROUP * VEC) == 0 && X % VEC == 0, "key vectors must not straddle X");
  static_assert(!PARTITIONED || PARTITION_SIZE % BLOCK_SIZE == 0, "partitions hold whole blocks");

  const int thread = threadIdx.x;
  const int warp = thread / WARP_SIZE;
  const int lane = thread % WARP_SIZE;
  const int head = blockIdx.x;
  const int num_heads = gridDim.x;
  const int seq = blockIdx.y;
  const int partition = blockIdx.z;  // counted from the window's first partition
  const int max_num_partitions = gridDim.z;
  const int seq_len = seq_lens[seq];
  const int first_token = window_start(seq_len, sliding_window);
  const int first_block = first_token / BLOCK_SIZE;
  const int abs_partition = PARTITIONED ? first_token / PARTITION_SIZE + partition : 0;
  if (PARTITIONED && abs_partition * PARTITION_SIZE >= seq_len) return;

  const int num_seq_blocks = div_up(seq_len, BLOCK_SIZE);
  const int blocks_per_partition = PARTITIONED ? PARTITION_SIZE / BLOCK_SIZE : num_seq_blocks;
  const int partition_block = abs_partition * blocks_per_partition;
  const int start_block = cmax(partition_block, first_block);
  const int end_block = cmin(partition_block + blocks_per_partition, num_seq_blocks);
  const int start_token = start_block * BLOCK_SIZE;
  const int num_tokens = cmin(end_block * BLOCK_SIZE, seq_len) - start_token;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int* block_table = block_tables + static_cast<int64>(seq) * max_num_blocks_per_seq;
  const float k_scale = FP8 ? f.k_scales[kv_head] * raw_scale<CACHE_T>() : 1.f;
  const float v_scale = FP8 ? f.v_scales[kv_head] * raw_scale<CACHE_T>() : 1.f;
  const float alibi_slope = FEATURES && f.alibi_slopes ? f.alibi_slopes[head] : 0.f;
  const bool sparse = FEATURES && f.bs_vert_stride > 0;
  const int q_sparse_block = sparse ? (seq_len - 1) / f.bs_block_size : 0;
  const int sparse_offset =
      f.bs_head_sliding_step >= 0 ? head * f.bs_head_sliding_step + 1 : kv_head * -f.bs_head_sliding_step + 1;

  __shared__ Vec<T, VEC> q_vecs[GROUP][VECS_PER_THREAD];
  __shared__ float red_smem[2 * NUM_WARPS];
  float* logits = reinterpret_cast<float*>(dynamic_smem());

  const int group_lane = thread % GROUP;
  const T* q_ptr = q + static_cast<int64>(seq) * q_stride + head * HEAD_SIZE;
  for (int i = thread / GROUP; i < VECS_PER_THREAD; i += NUM_GROUPS) {
    q_vecs[group_lane][i] = load_vec<T, VEC>(q_ptr + (group_lane + i * GROUP) * VEC);
  }
#ifndef PAGED_TEST_DROP_BARRIER
  __syncthreads();
#endif

  const int token_in_block = lane / GROUP;
  float qk_max = -FLT_MAX_;
  for (int block_idx = start_block + warp; block_idx < end_block; block_idx += NUM_WARPS) {
    if (sparse && !sparse_keeps(f, block_idx * BLOCK_SIZE, q_sparse_block, sparse_offset)) {
      if (group_lane == 0) logits[block_idx * BLOCK_SIZE + token_in_block - start_token] = -FLT_MAX_;
      continue;
    }
    const int64 physical_block = block_table[block_idx];
    const CACHE_T* k_ptr = k_cache + physical_block * kv_block_stride +
                           static_cast<int64>(kv_head) * kv_head_stride + token_in_block * X;
    float qk = 0.f;
#pragma unroll
    for (int j = 0; j < VECS_PER_THREAD; ++j) {
      const int elem = (group_lane + j * GROUP) * VEC;
      const Vec<CACHE_T, VEC> k = load_vec<CACHE_T, VEC>(k_ptr + (elem / X) * BLOCK_SIZE * X + elem % X);
      const Vec<T, VEC>& qv = q_vecs[group_lane][j];
      float kf[VEC];
      to_floats(k, kf);
#pragma unroll
      for (int e = 0; e < VEC; ++e) qk += to_float(qv.val[e]) * kf[e];
    }
    qk = scale * k_scale * warp_reduce<GROUP / 2>(qk, SumOp());
    if (group_lane == 0) {
      const int token = block_idx * BLOCK_SIZE + token_in_block;
      if (FEATURES) qk += alibi_slope * (token - seq_len + 1);
      // Masked slots get 0, not -inf: P·V multiplies them with zeroed V, and 0 * -inf is NaN.
      const bool masked = token >= seq_len || token < first_token;
      logits[token - start_token] = masked ? 0.f : qk;
      qk_max = masked ? qk_max : fmaxf(qk_max, qk);
    }
  }
  qk_max = block_reduce<NUM_WARPS>(red_smem, qk_max, -FLT_MAX_, MaxOp());

  // Slots before the window (in its first block only) get probability 0.
  const int num_before_window = first_token - start_token;
  float exp_sum = 0.f;
  for (int i = thread; i < num_tokens; i += NUM_THREADS) {
    const float e = i < num_before_window ? 0.f : __expf(logits[i] - qk_max);
    logits[i] = e;
    exp_sum += e;
  }
  exp_sum = block_reduce<NUM_WARPS>(&red_smem[NUM_WARPS], exp_sum, 0.f, SumOp());
  // The maximum logit contributes exp(0) = 1, so exp_sum >= 1 and needs no epsilon.
  const float inv_sum = __fdividef(1.f, exp_sum);
  for (int i = thread; i < num_tokens; i += NUM_THREADS) logits[i] *= inv_sum;
  __syncthreads();

  if (PARTITIONED && thread == 0) {
    const int64 idx = (static_cast<int64>(seq) * num_heads + head) * max_num_partitions + partition;
    max_logits[idx] = qk_max;
    exp_sums[idx] = exp_sum;
  }

  float accs[ROWS_PER_THREAD];
#pragma unroll
  for (int i = 0; i < ROWS_PER_THREAD; ++i) accs[i] = 0.f;
  const int v_offset = (lane % V_VECS_PER_ROW) * V_VEC;
  for (int block_idx = start_block + warp; block_idx < end_block; block_idx += NUM_WARPS) {
    if (sparse && !sparse_keeps(f, block_idx * BLOCK_SIZE, q_sparse_block, sparse_offset)) continue;
    const int64 physical_block = block_table[block_idx];
    const int lane_token = block_idx * BLOCK_SIZE + v_offset;
    float probs[V_VEC];
#pragma unroll
    for (int e = 0; e < V_VEC; ++e) probs[e] = logits[lane_token - start_token + e];
    const CACHE_T* v_ptr =
        v_cache + physical_block * kv_block_stride + static_cast<int64>(kv_head) * kv_head_stride;
    // Slots past seq_len in the last block may hold NaN from unwritten cache memory, and slots
    // before the window in its first block anything the sequence no longer needs.
    const bool edge_block = block_idx == num_seq_blocks - 1 || block_idx == first_block;
#pragma unroll
    for (int i = 0; i < ROWS_PER_THREAD; ++i) {
      const int row = lane / V_VECS_PER_ROW + i * ROWS_PER_ITER;
      if (row < HEAD_SIZE) {
        const Vec<CACHE_T, V_VEC> v = load_vec<CACHE_T, V_VEC>(v_ptr + row * BLOCK_SIZE + v_offset);
        float vf[V_VEC];
        to_floats(v, vf);
        float sum = 0.f;
#pragma unroll
        for (int e = 0; e < V_VEC; ++e) {
          const int token = lane_token + e;
          const bool masked = edge_block && (token >= seq_len || token < first_token);
          const float value = masked ? 0.f : vf[e];
          sum += probs[e] * value;
        }
        accs[i] += sum * v_scale;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < ROWS_PER_THREAD; ++i) accs[i] = warp_reduce<V_VECS_PER_ROW / 2>(accs[i], SumOp());

  // The logits are consumed; their shared memory now carries partial outputs between warps.
  __syncthreads();
  float* out_smem = logits;
  const bool row_owner = lane % V_VECS_PER_ROW == 0;
#pragma unroll
  for (int active = NUM_WARPS; active > 1; active /= 2) {
    const int mid = active / 2;
    if (warp >= mid && warp < active && row_owner) {
      float* dst = &out_smem[(warp - mid) * HEAD_SIZE];
#pragma unroll
      for (int i = 0; i < ROWS_PER_THREAD; ++i) {
        const int row = lane / V_VECS_PER_ROW + i * ROWS_PER_ITER;
        if (row < HEAD_SIZE) dst[row] = accs[i];
      }
    }
    __syncthreads();
    if (warp < mid && row_owner) {
      const float* src = &out_smem[warp * HEAD_SIZE];
#pragma unroll
      for (int i = 0; i < ROWS_PER_THREAD; ++i) {
        const int row = lane / V_VECS_PER_ROW + i * ROWS_PER_ITER;
        if (row < HEAD_SIZE) accs[i] += src[row];
      }
    }
    __syncthreads();
  }

  if (warp == 0 && row_owner) {
    OUT_T* out_ptr =
        out + ((static_cast<int64>(seq) * num_heads + head) * max_num_partitions + partition) * HEAD_SIZE;
#pragma unroll
    for (int i = 0; i < ROWS_PER_THREAD; ++i) {
      const int row = lane / V_VECS_PER_ROW + i * ROWS_PER_ITER;
      if (row < HEAD_SIZE) out_ptr[row] = from_float<OUT_T>(accs[i]);
    }
  }
}

// Grid (num_heads, num_seqs, 1); dynamic shared memory: max(padded max_seq_len, NUM_WARPS/2 *
// HEAD_SIZE) floats, where with a window the padded length needs only cover the window's blocks.
template <typename T, typename CACHE_T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, bool FEATURES>
__global__ void paged_attention_v1_kernel(T* __restrict__ out, const T* __restrict__ q,
                                          const CACHE_T* __restrict__ k_cache, const CACHE_T* __restrict__ v_cache,
                                          int num_kv_heads, float scale, const int* __restrict__ block_tables,
                                          const int* __restrict__ seq_lens, int max_num_blocks_per_seq,
                                          int q_stride, int kv_block_stride, int kv_head_stride,
                                          int sliding_window, FEATURE_PARAMS) {
  paged_attention<T, CACHE_T, T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, 0, FEATURES>(
      nullptr, nullptr, out, q, k_cache, v_cache, num_kv_heads, scale, block_tables, seq_lens,
      max_num_blocks_per_seq, q_stride, kv_block_stride, kv_head_stride, sliding_window, FEATURE_ARGS);
}

// Grid (num_heads, num_seqs, max_num_partitions), where with a window max_num_partitions need only
// cover the partitions one window reaches. The partial outputs stay fp32 so the reduce kernel
// rounds to T once.
template <typename T, typename CACHE_T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, int PARTITION_SIZE,
          bool FEATURES>
__global__ void paged_attention_v2_kernel(float* __restrict__ exp_sums, float* __restrict__ max_logits,
                                          float* __restrict__ tmp_out, const T* __restrict__ q,
                                          const CACHE_T* __restrict__ k_cache, const CACHE_T* __restrict__ v_cache,
                                          int num_kv_heads, float scale, const int* __restrict__ block_tables,
                                          const int* __restrict__ seq_lens, int max_num_blocks_per_seq,
                                          int q_stride, int kv_block_stride, int kv_head_stride,
                                          int sliding_window, FEATURE_PARAMS) {
  paged_attention<T, CACHE_T, float, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, PARTITION_SIZE, FEATURES>(
      exp_sums, max_logits, tmp_out, q, k_cache, v_cache, num_kv_heads, scale, block_tables, seq_lens,
      max_num_blocks_per_seq, q_stride, kv_block_stride, kv_head_stride, sliding_window, FEATURE_ARGS);
}

// Grid (num_heads, num_seqs); dynamic shared memory: max_num_partitions floats. Each partition's
// output is already normalised by its own exp_sum, so it is weighted by
// exp_sum * exp(max_logit - global_max) over the sum of those weights.
template <typename T, int HEAD_SIZE, int NUM_THREADS, int PARTITION_SIZE>
__global__ void paged_attention_v2_reduce_kernel(T* __restrict__ out, const float* __restrict__ exp_sums,
                                                 const float* __restrict__ max_logits,
                                                 const float* __restrict__ tmp_out,
                                                 const int* __restrict__ seq_lens, int max_num_partitions,
                                                 int sliding_window) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  const int thread = threadIdx.x;
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = seq_lens[seq];
  // The partitions the main kernel computed, numbered from the window's first.
  const int num_partitions = div_up(seq_len, PARTITION_SIZE) - window_start(seq_len, sliding_window) / PARTITION_SIZE;
  const int64 row = static_cast<int64>(seq) * gridDim.x + head;
  T* out_ptr = out + row * HEAD_SIZE;
  const float* tmp_ptr = tmp_out + row * max_num_partitions * HEAD_SIZE;
  if (num_partitions == 1) {
    for (int i = thread; i < HEAD_SIZE; i += NUM_THREADS) out_ptr[i] = from_float<T>(tmp_ptr[i]);
    return;
  }

  __shared__ float red_smem[2 * NUM_WARPS];
  float* weights = reinterpret_cast<float*>(dynamic_smem());
  const float* part_max = max_logits + row * max_num_partitions;
  const float* part_sum = exp_sums + row * max_num_partitions;

  float global_max = -FLT_MAX_;
  for (int i = thread; i < num_partitions; i += NUM_THREADS) global_max = fmaxf(global_max, part_max[i]);
  global_max = block_reduce<NUM_WARPS>(red_smem, global_max, -FLT_MAX_, MaxOp());

  float total = 0.f;
  for (int i = thread; i < num_partitions; i += NUM_THREADS) {
    const float w = part_sum[i] * __expf(part_max[i] - global_max);
    weights[i] = w;
    total += w;
  }
  // block_reduce's barrier also publishes every thread's weights.
  total = block_reduce<NUM_WARPS>(&red_smem[NUM_WARPS], total, 0.f, SumOp());
  const float inv_total = __fdividef(1.f, total);
  for (int i = thread; i < HEAD_SIZE; i += NUM_THREADS) {
    float acc = 0.f;
    for (int p = 0; p < num_partitions; ++p) acc += tmp_ptr[p * HEAD_SIZE + i] * weights[p];
    out_ptr[i] = from_float<T>(acc * inv_total);
  }
}

}  // namespace paged
