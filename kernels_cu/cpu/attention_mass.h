// Attention mass for the KV presses that score tokens by it (paged/kernels/attention_mass.py, the
// torch reference): for every sequence and KV head, each cached token's softmax weight summed over
// the sequence's last `last_queries` query rows (all rows with 0) and over the G query heads of the
// head's group, of logits soft-capped when soft_cap > 0. Causal in KV index: query row j of n sits at
// index seq_len - n + j. Written into
// `mass` fp32 [num_seqs, num_kv_heads, max_seq_len], zero where no query reaches. No window,
// ALiBi or block-sparse pattern (a press refuses them): plain scaled dot products, read from the
// paged cache in place (fp8 dequantised by its head's scale).
#pragma once

#include "common.h"

namespace paged_cpu {

template <typename C>
void run_attention_mass(const Args& a, float* mass, int last_queries, int max_seq_len, float soft_cap) {
  const int G = a.num_heads / a.num_kv_heads, D = a.head_size, BS = a.block_size;
  constexpr int x = x_of<C>();
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(a.num_threads)
  for (int s = 0; s < a.num_seqs; ++s) {
    for (int kvh = 0; kvh < a.num_kv_heads; ++kvh) {
      const int len = a.seq_lens[s];
      const int row_end = a.query_start_loc[s + 1];
      int row_begin = a.query_start_loc[s];
      if (last_queries > 0) row_begin = std::max(row_begin, row_end - last_queries);
      const int n = a.query_start_loc[s + 1] - a.query_start_loc[s];
      const float ks = kv_scale(a.k_scale, kvh);
      float* out = mass + (static_cast<int64_t>(s) * a.num_kv_heads + kvh) * max_seq_len;
      std::vector<float> q(D), logits(len);
      for (int row = row_begin; row < row_end; ++row) {
        const int visible = len - n + (row - a.query_start_loc[s]) + 1;  // keys 0 .. its own index
        for (int g = 0; g < G; ++g) {
          const int head = kvh * G + g;
          load_query_row(a, row * a.q_stride_seq + head * a.q_stride_head, D, q.data());
          float top = -std::numeric_limits<float>::infinity();
          for (int k = 0; k < visible; ++k) {
            const int64_t blk = a.block_tables[s * a.bt_stride + k / BS];
            const typename C::storage* tile = tile_ptr<C>(a.key_cache, a, blk, kvh);
            const int slot = k % BS;
            float dot = 0.f;
            for (int d = 0; d < D; ++d) dot += q[d] * dequant<C>(tile[((d / x) * BS + slot) * x + d % x], ks);
            logits[k] = dot * a.scale;
            if (soft_cap > 0.f) logits[k] = std::tanh(logits[k] / soft_cap) * soft_cap;
            top = std::max(top, logits[k]);
          }
          float sum = 0.f;
          for (int k = 0; k < visible; ++k) sum += (logits[k] = std::exp(logits[k] - top));
          for (int k = 0; k < visible; ++k) out[k] += logits[k] / sum;
        }
      }
    }
  }
}

}  // namespace paged_cpu
