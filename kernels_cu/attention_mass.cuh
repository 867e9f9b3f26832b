// Attention mass for the KV presses that score tokens by it (paged/kernels/backends/torch_mass.py is
// the reference): for every sequence and KV head, each cached token's softmax weight summed over the
// sequence's last `last_queries` query rows (all rows with 0) and over the G query heads of the
// head's group. Causal in KV index: query row j of a sequence's n rows sits at index seq_len - n + j.
// Soft-capped logits with soft_cap > 0. No window, ALiBi or block-sparse pattern (a press refuses
// them): plain scaled dot products read from the paged cache in place, fp8 dequantised by its head's
// scale.
//
// Two launches, so that every output element has one writer and no atomics are needed: the first
// finds each counted (row, head)'s log-sum-exp over the keys it sees, the second gives every key a
// thread that sums exp(logit - lse) over the counted rows and the group's heads. Both compute a logit
// the same way (mass_logit), so each row's weights sum to 1 up to rounding.
#pragma once

#include "compat.cuh"

namespace paged {

constexpr int MASS_THREADS = 128;
constexpr int MASS_MAX_HEAD = 256;

// The arguments both launches take, in this order (paged/kernels/backends/mass_plan.py).
#define PAGED_MASS_PARAMS                                                                                     \
  const T *__restrict__ query, const CACHE_T *__restrict__ key_cache, const int *__restrict__ block_tables,   \
      const int *__restrict__ seq_lens, const int *__restrict__ query_start_loc, int num_heads,                \
      int num_kv_heads, int head_size, int x, int block_size, int max_blocks, int q_stride,                    \
      int kv_block_stride, int kv_head_stride, float scale, float soft_cap, const float *__restrict__ k_scales, \
      int last_queries

// The first counted query row of sequence `seq` (rows end at query_start_loc[seq + 1]).
PAGED_DEVICE int mass_first_row(const int* query_start_loc, int seq, int last_queries) {
  const int begin = query_start_loc[seq], end = query_start_loc[seq + 1];
  return last_queries > 0 ? cmax(begin, end - last_queries) : begin;
}

// Query row `row`, head `head` into shared `q` (fp32), by the whole block.
template <typename T>
PAGED_DEVICE void mass_load_query(const T* query, int q_stride, int head, int head_size, int row, float* q) {
  __syncthreads();  // the previous row's readers are done with `q`
  for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
    q[d] = to_float(query[static_cast<int64>(row) * q_stride + head * head_size + d]);
  }
  __syncthreads();
}

// The (soft-capped) scaled logit of query `q` on cached key `k` of sequence `seq`, KV head `kvh`.
template <typename CACHE_T>
PAGED_DEVICE float mass_logit(const float* q, const CACHE_T* key_cache, const int* table, int k, int kvh,
                              int head_size, int x, int block_size, int kv_block_stride, int kv_head_stride,
                              float k_scale, float scale, float soft_cap) {
  const int64 block = table[k / block_size];
  const int slot = k % block_size;
  const CACHE_T* tile = key_cache + block * kv_block_stride + static_cast<int64>(kvh) * kv_head_stride;
  float dot = 0.f;
  for (int d = 0; d < head_size; ++d) dot += q[d] * to_float(tile[((d / x) * block_size + slot) * x + d % x]);
  float logit = dot * k_scale * scale;
  if (soft_cap > 0.f) logit = tanhf(logit / soft_cap) * soft_cap;
  return logit;
}

// Grid (max counted rows, num_kv_heads, num_seqs): the block of (j, kvh, seq) writes `lse` [num_tokens,
// num_heads] of the sequence's j-th counted row for the G heads of KV head kvh.
template <typename T, typename CACHE_T>
__global__ void attention_mass_lse_kernel(float* __restrict__ lse, PAGED_MASS_PARAMS) {
  const int seq = blockIdx.z, kvh = blockIdx.y;
  const int row = mass_first_row(query_start_loc, seq, last_queries) + blockIdx.x;
  const int row_end = query_start_loc[seq + 1];
  if (row >= row_end) return;
  __shared__ float q[MASS_MAX_HEAD];
  __shared__ float top[MASS_THREADS];
  __shared__ float total[MASS_THREADS];
  const int len = seq_lens[seq];
  const int visible = len - (row_end - query_start_loc[seq]) + (row - query_start_loc[seq]) + 1;
  const int* table = block_tables + static_cast<int64>(seq) * max_blocks;
  const float k_scale = k_scales ? k_scales[kvh] : 1.f;
  const int group = num_heads / num_kv_heads;
  for (int g = 0; g < group; ++g) {
    const int head = kvh * group + g;
    mass_load_query(query, q_stride, head, head_size, row, q);
    // each thread's online softmax over its keys, then a tree over the block's threads
    float m = negative_infinity(), s = 0.f;
    for (int k = threadIdx.x; k < visible; k += blockDim.x) {
      const float l = mass_logit(q, key_cache, table, k, kvh, head_size, x, block_size, kv_block_stride,
                                 kv_head_stride, k_scale, scale, soft_cap);
      if (l > m) {
        s = s * expf(m - l) + 1.f;
        m = l;
      } else {
        s += expf(l - m);
      }
    }
    top[threadIdx.x] = m;
    total[threadIdx.x] = s;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) {
        const float m2 = top[threadIdx.x + half], s2 = total[threadIdx.x + half];
        const float m1 = top[threadIdx.x], s1 = total[threadIdx.x];
        const float mm = fmaxf(m1, m2);
        // a thread that saw no key holds (-inf, 0): it adds nothing
        total[threadIdx.x] = (s1 > 0.f ? s1 * expf(m1 - mm) : 0.f) + (s2 > 0.f ? s2 * expf(m2 - mm) : 0.f);
        top[threadIdx.x] = mm;
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) lse[static_cast<int64>(row) * num_heads + head] = top[0] + logf(total[0]);
  }
}

// Grid (ceil(max_seq_len / MASS_THREADS), num_kv_heads, num_seqs): a thread per cached key, writing its
// mass to `mass` fp32 [num_seqs, num_kv_heads, max_seq_len] (keys past seq_len are not written).
template <typename T, typename CACHE_T>
__global__ void attention_mass_kernel(float* __restrict__ mass, const float* __restrict__ lse, int max_seq_len,
                                      PAGED_MASS_PARAMS) {
  const int seq = blockIdx.z, kvh = blockIdx.y;
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  const int len = seq_lens[seq];
  if (static_cast<int>(blockIdx.x) * static_cast<int>(blockDim.x) >= len) return;  // the whole block
  __shared__ float q[MASS_MAX_HEAD];
  const int begin = query_start_loc[seq], row_end = query_start_loc[seq + 1];
  const int* table = block_tables + static_cast<int64>(seq) * max_blocks;
  const float k_scale = k_scales ? k_scales[kvh] : 1.f;
  const int group = num_heads / num_kv_heads;
  float acc = 0.f;
  for (int row = mass_first_row(query_start_loc, seq, last_queries); row < row_end; ++row) {
    const int visible = len - (row_end - begin) + (row - begin) + 1;
    for (int g = 0; g < group; ++g) {
      const int head = kvh * group + g;
      mass_load_query(query, q_stride, head, head_size, row, q);
      if (k < visible) {
        const float l = mass_logit(q, key_cache, table, k, kvh, head_size, x, block_size, kv_block_stride,
                                   kv_head_stride, k_scale, scale, soft_cap);
        acc += expf(l - lse[static_cast<int64>(row) * num_heads + head]);
      }
    }
  }
  if (k < len) mass[(static_cast<int64>(seq) * num_kv_heads + kvh) * max_seq_len + k] = acc;
}

#undef PAGED_MASS_PARAMS

}  // namespace paged
