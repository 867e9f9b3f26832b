// Shared by the cpu backend's decode and prefill attention: dtypes and their conversions, the
// argument block both entry points fill, the cache tile addressing and the attention features.
//
// Layouts (elements, all contiguous except the query):
//   key_cache   [num_blocks, num_kv_heads, head_size / x, block_size, x], x = 16 / element_size
//   value_cache [num_blocks, num_kv_heads, head_size, block_size]
//   block_tables int32 [num_seqs, >= ceil(seq_len / block_size)], row stride passed
//   seq_lens    int32 [num_seqs]
//   query       [rows, num_heads, head_size] with arbitrary strides (e.g. a view of fused qkv)
//   out         [rows, num_heads, head_size], contiguous, query dtype
// The cache holds a float dtype (the query's, or another one: kernel.kv_cache_dtype, e.g. a bf16
// query over an fp32 cache, x = 4) or fp8 (e4m3fn / e5m2, x = 16) read as value * its KV head's
// scale; x is always the cache element's. The kernels are templates over the cache's element type,
// which their inner loops read as fp32; the query and output are converted a row at a time, so
// their dtype is a runtime switch independent of the cache's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "fp8.h"

namespace paged_cpu {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kE4M3 = 3, kE5M2 = 4 };

// ---- 16-bit conversions -----------------------------------------------------------------------

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, like torch
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__FLT16_MAX__)
using half_t = _Float16;
inline float f16_to_float(half_t h) { return static_cast<float>(h); }
inline half_t float_to_f16(float f) { return static_cast<half_t>(f); }
#else
#error "this compiler has no _Float16; use g++ >= 12 on x86-64 or aarch64"
#endif

struct F32 {
  using storage = float;
  static float load(storage v) { return v; }
  static storage store(float v) { return v; }
};
struct F16 {
  using storage = half_t;
  static float load(storage v) { return f16_to_float(v); }
  static storage store(float v) { return float_to_f16(v); }
};
struct BF16 {
  using storage = uint16_t;
  static float load(storage v) { return bf16_to_float(v); }
  static storage store(float v) { return float_to_bf16(v); }
};
// fp8 caches are only read here (reshape_and_cache is the torch reference's).
struct E4M3 {
  using storage = uint8_t;
  static float load(storage v) { return paged_fp8::e4m3_to_float(v); }
};
struct E5M2 {
  using storage = uint8_t;
  static float load(storage v) { return paged_fp8::e5m2_to_float(v); }
};

template <typename C>
constexpr bool is_fp8() { return sizeof(typename C::storage) == 1; }

// A cache element as fp32: an fp8 one times its KV head's scale.
template <typename C>
inline float dequant(typename C::storage v, float scale) {
  if constexpr (is_fp8<C>()) {
    return C::load(v) * scale;
  } else {
    return C::load(v);
  }
}

// vLLM's block-sparse pattern (paged/kernels/features.py), off when local_blocks is 0. Its block
// size is a multiple of the cache's (checked in run), so a cache block lies in one sparse block
// and is seen or not as a whole.
struct BlockSparse {
  int local_blocks, vert_stride, block_size, head_sliding_step;

  bool on() const { return local_blocks != 0; }
  // Query head `head`'s vertical offset; a negative step slides per KV head (group of G heads).
  int64_t offset(int head, int G) const {
    return head_sliding_step >= 0 ? static_cast<int64_t>(head) * head_sliding_step + 1
                                  : static_cast<int64_t>(head / G) * -static_cast<int64_t>(head_sliding_step) + 1;
  }
  // Whether a query at position q sees key position k <= q (causality is the caller's).
  bool sees(int q, int k, int64_t offset) const {
    const int q_block = q / block_size, k_block = k / block_size;
    return k_block > q_block - local_blocks || (k_block + offset) % vert_stride == 0;
  }
  // Which of the G query heads from `head0` (one KV head's group) see key position k from a query at
  // q, into sees[0, G); whether any does.
  bool mark_group(char* sees, int q, int k, int head0, int G) const {
    bool any = false;
    for (int g = 0; g < G; ++g) {
      sees[g] = this->sees(q, k, offset(head0 + g, G));
      any |= sees[g];
    }
    return any;
  }
};

struct Args {
  int dtype, cache_dtype;  // DType of the query and output; of the cache
  void* out;
  const void* query;
  int64_t q_stride_seq, q_stride_head, q_stride_dim;  // seq: the stride between query rows
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  int num_seqs, num_heads, num_kv_heads, head_size, block_size;
  float scale;
  int sliding_window;  // 0: the whole context; else W, a query at p sees positions p - W < k <= p
  const float* k_scale;  // fp8 caches: [num_kv_heads] dequantisation scales; else null
  const float* v_scale;
  const float* alibi_slopes;  // [num_heads], logits get slope * (key - query position); or null
  BlockSparse sparse;
  const int32_t* query_start_loc;  // prefill only: [num_seqs + 1] row offsets
  int partition_size;  // decode v2 only
  int max_seq_len;     // decode only
  int max_query_len;   // prefill only
  int num_threads;
};

template <typename C>
constexpr int x_of() { return 16 / static_cast<int>(sizeof(typename C::storage)); }

// Below this many elements a cache write runs on the calling thread: waking the pool costs more.
constexpr int64_t kCacheWriteParallelGrain = 16384;

// The slot walk of reshape_and_cache (same dtype, layer_ops.h) and convert_and_cache (cache_convert.h):
// for every token t whose slot is >= 0 (the caller checked the others are < num_blocks * block_size)
// and every KV head h, `write(t, h, kd, vd)` with kd / vd the token's first K / V element in that
// head's tile (K at offset * x, V at offset; layouts above). Parallel over tokens for large writes.
template <int x, typename Dst, typename Write>
inline void for_each_cache_slot(Dst* key_cache, Dst* value_cache, const int64_t* slots, int64_t T, int kv_heads,
                                int head_size, int block_size, int num_threads, Write write) {
  const int64_t tile = static_cast<int64_t>(head_size) * block_size;  // one (block, head) tile
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (T * kv_heads * head_size >= kCacheWriteParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int h = 0; h < kv_heads; ++h)
      write(t, h, key_cache + (block * kv_heads + h) * tile + offset * x,
            value_cache + (block * kv_heads + h) * tile + offset);
  }
}

// Slots of a block group on the AVX-512 paths (decode_v3_grouped.h, prefill.h's bf16 tile): a
// group's logits and softmax first, then its weights multiply its V tiles in one pass over the
// value sums, whose loads and stores dominate per block, as do a row's softmax reductions.
constexpr int kGroupSlots = 64;

// The dequantisation scale of KV head `kvh` in `scales` (1 for a cache that is not fp8).
inline float kv_scale(const float* scales, int kvh) { return scales ? scales[kvh] : 1.f; }

// ALiBi on the logits of `n` consecutive keys, the first `rel` positions after the query's.
inline void add_alibi(float* logits, int n, float slope, int rel) {
  for (int i = 0; i < n; ++i) logits[i] += slope * static_cast<float>(rel + i);
}

// A query head's row as fp32, an output row from fp32: in the model dtype, one switch per row.
template <typename T>
inline void load_row_as(const void* base, int64_t offset, int64_t stride, int n, float* dst) {
  const typename T::storage* src = static_cast<const typename T::storage*>(base) + offset;
  for (int i = 0; i < n; ++i) dst[i] = T::load(src[i * stride]);
}

inline void load_query_row(const Args& a, int64_t offset, int n, float* dst) {
  switch (a.dtype) {
    case kF32: load_row_as<F32>(a.query, offset, a.q_stride_dim, n, dst); break;
    case kF16: load_row_as<F16>(a.query, offset, a.q_stride_dim, n, dst); break;
    default: load_row_as<BF16>(a.query, offset, a.q_stride_dim, n, dst); break;
  }
}

template <typename T>
inline void store_row_as(void* base, int64_t offset, int n, const float* src) {
  typename T::storage* dst = static_cast<typename T::storage*>(base) + offset;
  for (int i = 0; i < n; ++i) dst[i] = T::store(src[i]);
}

inline void store_out_row(const Args& a, int64_t offset, int n, const float* src) {
  switch (a.dtype) {
    case kF32: store_row_as<F32>(a.out, offset, n, src); break;
    case kF16: store_row_as<F16>(a.out, offset, n, src); break;
    default: store_row_as<BF16>(a.out, offset, n, src); break;
  }
}

// The first position a query at `position` attends to. Blocks wholly before it are never read:
// the block manager frees them, so their table entries may name blocks other sequences now own.
inline int window_start(const Args& a, int position) {
  return a.sliding_window > 0 && position >= a.sliding_window ? position - a.sliding_window + 1 : 0;
}

template <typename C>
inline const typename C::storage* tile_ptr(const void* cache, const Args& a, int64_t blk, int kv_head) {
  const int64_t tile = static_cast<int64_t>(a.head_size) * a.block_size;
  return static_cast<const typename C::storage*>(cache) + (blk * a.num_kv_heads + kv_head) * tile;
}

}  // namespace paged_cpu
