// Token slot copies of KV compression (backend "cpu", paged.kernels.copy_slots): for every layer and
// every (src, dst) row of the mapping, the K and V of slot src are written to slot dst. A layer's
// sources are all gathered before any of its destinations is written, so a destination may be
// another pair's source. A slot is block * block_size + offset in caches laid out as
// key [num_blocks, heads, head_size / x, block_size, x] (x elements = 16 bytes) and value
// [num_blocks, heads, head_size, block_size]; layers run in parallel, each with its own buffer.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace paged_cpu {

template <typename E>  // an unsigned integer of the element's size: values move as bits
void copy_slots(int num_layers, const int64_t* key_caches, const int64_t* value_caches,
                const int64_t* slot_mapping, int64_t num_pairs, int num_heads, int head_size, int block_size,
                int num_threads) {
  constexpr int x = 16 / sizeof(E);
  const int chunks = head_size / x;
  const int64_t token = static_cast<int64_t>(num_heads) * head_size;  // elements of K (or V) per slot
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int layer = 0; layer < num_layers; ++layer) {
    E* key = reinterpret_cast<E*>(key_caches[layer]);
    E* value = reinterpret_cast<E*>(value_caches[layer]);
    std::vector<E> keys(num_pairs * token), values(num_pairs * token);
    for (int pass = 0; pass < 2; ++pass) {  // 0: gather the sources, 1: scatter to the destinations
      for (int64_t pair = 0; pair < num_pairs; ++pair) {
        const int64_t slot = slot_mapping[2 * pair + pass], block = slot / block_size, offset = slot % block_size;
        E* k_row = keys.data() + pair * token;
        E* v_row = values.data() + pair * token;
        for (int h = 0; h < num_heads; ++h) {
          const int64_t head = block * num_heads + h;
          for (int c = 0; c < chunks; ++c) {
            E* at = key + ((head * chunks + c) * block_size + offset) * x;
            E* row = k_row + (static_cast<int64_t>(h) * chunks + c) * x;
            if (pass) std::memcpy(at, row, 16); else std::memcpy(row, at, 16);
          }
          E* column = value + head * head_size * block_size + offset;
          E* row = v_row + static_cast<int64_t>(h) * head_size;
          for (int d = 0; d < head_size; ++d) {
            if (pass) column[d * block_size] = row[d]; else row[d] = column[d * block_size];
          }
        }
      }
    }
  }
}

}  // namespace paged_cpu
