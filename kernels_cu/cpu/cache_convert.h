// reshape_and_cache into a KV cache of another float dtype than the activations' (backend "cpu",
// kernel.kv_cache_dtype): a bf16 model over an fp32 cache, an fp32 model over a bf16 one. Each
// element is converted as it is stored: widening is exact, narrowing rounds to nearest even, as
// torch's `.to` does, so the cache holds what the torch reference writes bit for bit. The
// same-dtype copy is layer_ops.h's; fp8 caches are quantised by the torch reference.
#pragma once

#include <cstdint>

#include "common.h"

namespace paged_cpu {

// key / value [T, kv_heads, head_size] of element type S with any element strides, into caches of
// element type D (layouts in common.h, x of D). Slots < 0 are skipped; the caller checked every
// other slot is < num_blocks * block_size.
template <typename S, typename D>
void convert_and_cache(const void* key, const int64_t* ks, const void* value, const int64_t* vs, void* key_cache,
                       void* value_cache, const int64_t* slots, int64_t T, int kv_heads, int head_size, int block_size,
                       int num_threads) {
  using Src = typename S::storage;
  using Dst = typename D::storage;
  constexpr int x = x_of<D>();
  const Src* keys = static_cast<const Src*>(key);
  const Src* values = static_cast<const Src*>(value);
  for_each_cache_slot<x>(static_cast<Dst*>(key_cache), static_cast<Dst*>(value_cache), slots, T, kv_heads, head_size,
                         block_size, num_threads, [&](int64_t t, int h, Dst* kd, Dst* vd) {
    const Src* k = keys + t * ks[0] + h * ks[1];
    const Src* v = values + t * vs[0] + h * vs[1];
    for (int d = 0; d < head_size; ++d)
      kd[static_cast<int64_t>(d / x) * block_size * x + d % x] = D::store(S::load(k[d * ks[2]]));
    for (int d = 0; d < head_size; ++d) vd[static_cast<int64_t>(d) * block_size] = D::store(S::load(v[d * vs[2]]));
  });
}

// f(T{}) for the float type of DType `code` (kF32, kF16 or kBF16; the caller checked).
template <typename F>
void with_float_type(int code, F f) {
  switch (code) {
    case kF32: f(F32{}); return;
    case kF16: f(F16{}); return;
    default: f(BF16{}); return;
  }
}

// The write for activations of DType `dtype` into caches of DType `cache_dtype`, both float.
inline void convert_and_cache_any(int dtype, int cache_dtype, const void* key, const int64_t* ks, const void* value,
                                  const int64_t* vs, void* key_cache, void* value_cache, const int64_t* slots,
                                  int64_t T, int kv_heads, int head_size, int block_size, int num_threads) {
  with_float_type(dtype, [&](auto src) {
    with_float_type(cache_dtype, [&](auto dst) {
      convert_and_cache<decltype(src), decltype(dst)>(key, ks, value, vs, key_cache, value_cache, slots, T, kv_heads,
                                                      head_size, block_size, num_threads);
    });
  });
}

}  // namespace paged_cpu
