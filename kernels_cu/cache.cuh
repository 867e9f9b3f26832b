// KV cache writes (reshape_and_cache), copy-on-write block copies (copy_blocks) and the token slot
// copies of KV compression (copy_slots, as move_slots launches).
#pragma once

#include "compat.cuh"

namespace paged {

// A value as the cache stores it: itself, or for fp8 x / scale clamped to the format's finite
// range (NaN kept) and rounded to nearest even, as the torch reference does.
template <typename CACHE_T, typename T>
PAGED_DEVICE CACHE_T to_cache(T x, const float* scales, int head) {
  if constexpr (sizeof(CACHE_T) == 1) {
    const float limit = Fp8Max<CACHE_T>::value;
    const float scaled = to_float(x) / scales[head];
    return from_float<CACHE_T>(scaled != scaled ? scaled : fminf(fmaxf(scaled, -limit), limit));
  } else {
    return x;
  }
}

// Where element `i` (head * head_size + dim) of the token in `slot` lives in vLLM's paged layout:
// K [blocks, heads, head_size / x, block_size, x], V [blocks, heads, head_size, block_size].
struct SlotElement {
  int64 key;
  int64 value;
};

PAGED_DEVICE SlotElement slot_element(int64 slot, int i, int num_heads, int head_size, int block_size, int x) {
  const int64 block = slot / block_size;
  const int offset = static_cast<int>(slot % block_size);
  const int head = i / head_size;
  const int dim = i % head_size;
  return {(((block * num_heads + head) * (head_size / x) + dim / x) * block_size + offset) * x + dim % x,
          ((block * num_heads + head) * head_size + dim) * block_size + offset};
}

// Grid (num_tokens); slot -1 marks a padding token whose K/V must not be written.
template <typename T, typename CACHE_T>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         CACHE_T* __restrict__ key_cache, CACHE_T* __restrict__ value_cache,
                                         const int64* __restrict__ slot_mapping, int key_stride, int value_stride,
                                         int num_heads, int head_size, int block_size, int x,
                                         const float* __restrict__ k_scales, const float* __restrict__ v_scales) {
  const int64 token = blockIdx.x;
  const int64 slot = slot_mapping[token];
  if (slot < 0) return;
  const int n = num_heads * head_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const SlotElement at = slot_element(slot, i, num_heads, head_size, block_size, x);
    const int head = i / head_size;
    key_cache[at.key] = to_cache<CACHE_T>(key[token * key_stride + i], k_scales, head);
    value_cache[at.value] = to_cache<CACHE_T>(value[token * value_stride + i], v_scales, head);
  }
}

// Grid (num_layers, num_pairs): every layer's K and V caches in one launch. The cache pointers
// arrive as int64 arrays because the number of layers is only known at run time.
template <typename T>
__global__ void copy_blocks_kernel(const int64* __restrict__ key_cache_ptrs, const int64* __restrict__ value_cache_ptrs,
                                   const int64* __restrict__ block_mapping, int numel_per_block) {
  T* key_cache = reinterpret_cast<T*>(key_cache_ptrs[blockIdx.x]);
  T* value_cache = reinterpret_cast<T*>(value_cache_ptrs[blockIdx.x]);
  const int64 src = block_mapping[2 * blockIdx.y] * numel_per_block;
  const int64 dst = block_mapping[2 * blockIdx.y + 1] * numel_per_block;
  for (int i = threadIdx.x; i < numel_per_block; i += blockDim.x) {
    key_cache[dst + i] = key_cache[src + i];
    value_cache[dst + i] = value_cache[src + i];
  }
}

// Grid (num_pairs): one half of copy_slots on one layer. `scatter` 0 gathers the K and V of each pair's
// source slot (slot_mapping[2 * pair]) into row `pair` of the buffers ([num_pairs, num_heads * head_size]);
// 1 writes row `pair` into its destination slot (slot_mapping[2 * pair + 1]). A gather launch then a
// scatter launch on one stream read every source before any destination is written, so a destination
// may be another pair's source.
template <typename CACHE_T>
__global__ void move_slots_kernel(CACHE_T* __restrict__ key_cache, CACHE_T* __restrict__ value_cache,
                                  CACHE_T* __restrict__ key_buffer, CACHE_T* __restrict__ value_buffer,
                                  const int64* __restrict__ slot_mapping, int num_heads, int head_size,
                                  int block_size, int x, int scatter) {
  const int64 pair = blockIdx.x;
  const int64 slot = slot_mapping[2 * pair + scatter];
  const int n = num_heads * head_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const SlotElement at = slot_element(slot, i, num_heads, head_size, block_size, x);
    if (scatter) {
      key_cache[at.key] = key_buffer[pair * n + i];
      value_cache[at.value] = value_buffer[pair * n + i];
    } else {
      key_buffer[pair * n + i] = key_cache[at.key];
      value_buffer[pair * n + i] = value_cache[at.value];
    }
  }
}

}  // namespace paged
