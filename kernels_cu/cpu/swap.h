// Block swaps between two KV pools in host memory (backend "cpu"): for every cache c and every
// (src, dst) row of the mapping, copy block_bytes[c] bytes from src_caches[c] + src * block_bytes[c]
// to dst_caches[c] + dst * block_bytes[c]. The caches are contiguous, and the front end checked the
// ids and that no destination block is written twice, so the copies are independent.
#pragma once

#include <cstdint>
#include <cstring>

namespace paged_cpu {

inline void swap_blocks(int num_caches, const int64_t* src_caches, const int64_t* dst_caches,
                        const int64_t* block_bytes, const int64_t* block_mapping, int64_t num_pairs,
                        int num_threads) {
  const int64_t copies = num_caches * num_pairs;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t i = 0; i < copies; ++i) {
    const int64_t cache = i / num_pairs, pair = i % num_pairs, bytes = block_bytes[cache];
    const char* src = reinterpret_cast<const char*>(src_caches[cache]) + block_mapping[2 * pair] * bytes;
    char* dst = reinterpret_cast<char*>(dst_caches[cache]) + block_mapping[2 * pair + 1] * bytes;
    std::memcpy(dst, src, bytes);
  }
}

}  // namespace paged_cpu
