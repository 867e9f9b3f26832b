// Shared by the cpu backend's decode and prefill attention: dtypes, 16-bit conversions, the
// argument block both entry points fill, and the cache tile addressing.
//
// Layouts (elements, all contiguous except the query):
//   key_cache   [num_blocks, num_kv_heads, head_size / x, block_size, x], x = 16 / element_size
//   value_cache [num_blocks, num_kv_heads, head_size, block_size]
//   block_tables int32 [num_seqs, >= ceil(seq_len / block_size)], row stride passed
//   seq_lens    int32 [num_seqs]
//   query       [rows, num_heads, head_size] with arbitrary strides (e.g. a view of fused qkv)
//   out         [rows, num_heads, head_size], contiguous, query dtype
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace paged_cpu {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

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

struct Args {
  void* out;
  const void* query;
  int64_t q_stride_seq, q_stride_head, q_stride_dim;  // seq: the stride between query rows
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;  // prefill only: [num_seqs + 1] row offsets
  int num_seqs, num_heads, num_kv_heads, head_size, block_size;
  float scale;
  int sliding_window;  // 0: the whole context; else W, a query at p sees positions p - W < k <= p
  int partition_size;  // decode v2 only
  int max_seq_len;     // decode only
  int max_query_len;   // prefill only
  int num_threads;
};


template <typename T>
constexpr int x_of() { return 16 / static_cast<int>(sizeof(typename T::storage)); }

// The first position a query at `position` attends to. Blocks wholly before it are never read:
// the block manager frees them, so their table entries may name blocks other sequences now own.
inline int window_start(const Args& a, int position) {
  return a.sliding_window > 0 && position >= a.sliding_window ? position - a.sliding_window + 1 : 0;
}

template <typename T>
inline const typename T::storage* tile_ptr(const void* cache, const Args& a, int64_t blk, int kv_head) {
  const int64_t tile = static_cast<int64_t>(a.head_size) * a.block_size;
  return static_cast<const typename T::storage*>(cache) + (blk * a.num_kv_heads + kv_head) * tile;
}

}  // namespace paged_cpu
