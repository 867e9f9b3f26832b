// Sanitizer scenarios of kernels_cu/prefill.cuh, included by sanitizer_driver.cpp: varlen batches
// of whole prompts, prefix hits and chunks (several row tiles and K/V tiles), GQA, and with a
// sliding window the table entries of blocks wholly before each sequence's first query's window
// stale (far outside the caches), so a kernel that reads one faults. Buffers are exactly sized and
// shared memory is the kernel's `PrefillTiles` (backends/launch.py's `prefill_shared_memory`).
#pragma once

namespace {

template <typename T, int HEAD, int BLOCK, typename CACHE_T = T, bool FEATURES = false>
int prefill(std::mt19937& rng, int sliding_window = 0) {
  // (queries, context) per sequence: a whole prompt over two row tiles, a prefix hit, a decode row,
  // and the longest last, so its table row is the buffer's last.
  const std::vector<int> q_lens = {70, 5, 1, 40};
  const std::vector<int> seq_lens = {70, 3 * BLOCK + 7, 2 * BLOCK, 100};
  const int num_seqs = int(seq_lens.size()), num_heads = 4, num_kv_heads = 2, group = num_heads / num_kv_heads;
  const int max_blocks = paged::div_up(seq_lens.back(), BLOCK);
  const int num_blocks = max_blocks + 2;
  std::vector<CACHE_T> k = random_values<CACHE_T>(std::size_t(num_blocks) * num_kv_heads * HEAD * BLOCK, rng);
  std::vector<CACHE_T> v = random_values<CACHE_T>(k.size(), rng);
  std::vector<int> starts = {0};
  for (int q : q_lens) starts.push_back(starts.back() + q);
  const std::size_t q_size = std::size_t(starts.back()) * num_heads * HEAD;
  std::vector<T> q = random_values<T>(q_size, rng), out(q_size);
  std::vector<int> tables(std::size_t(num_seqs) * max_blocks);
  for (std::size_t i = 0; i < tables.size(); ++i) tables[i] = int(rng() % num_blocks);
  tables.back() = num_blocks - 1;
  for (int seq = 0; seq < num_seqs; ++seq) {
    const int first_query = seq_lens[seq] - q_lens[seq];
    const int first_block = paged::window_start(first_query + 1, sliding_window) / BLOCK;
    for (int b = 0; b < first_block; ++b) tables[std::size_t(seq) * max_blocks + b] = kStaleBlock;
  }
  FeatureArgs<CACHE_T, BLOCK, FEATURES> features(num_heads, num_kv_heads);

  T* out_p = out.data();
  const T* q_p = q.data();
  const CACHE_T *k_p = k.data(), *v_p = v.data();
  const int *tables_p = tables.data(), *lens_p = seq_lens.data(), *starts_p = starts.data();
  int heads = num_heads, kv_heads = num_kv_heads, blocks_per_seq = max_blocks, q_stride = num_heads * HEAD;
  int block_stride = num_kv_heads * HEAD * BLOCK, head_stride = HEAD * BLOCK, window = sliding_window;
  float scale = 1.0f / std::sqrt(float(HEAD));
  void* args[] = {&out_p,    &q_p,    &k_p,      &v_p,            &heads,    &kv_heads,     &scale,
                  &tables_p, &lens_p, &starts_p, &blocks_per_seq, &q_stride, &block_stride, &head_stride,
                  &window,   FEATURE_ARG_PTRS(features)};
  const int max_q = *std::max_element(q_lens.begin(), q_lens.end());
  typedef paged::PrefillTiles<T, CACHE_T, HEAD> Tiles;
  LaunchDims dims{{unsigned(paged::div_up(max_q * group, Tiles::ROWS)), unsigned(num_kv_heads), unsigned(num_seqs)},
                  {paged::PREFILL_THREADS, 1, 1},
                  static_cast<unsigned long long>(Tiles::BYTES)};
  return run(paged_emu::launch(&paged::prefill_attention_kernel<T, CACHE_T, HEAD, BLOCK, FEATURES>, dims, args),
             "prefill");
}

inline int prefill_scenarios(std::mt19937& rng) {
  // Tensor cores (fp16 with a window shorter than a tile, bf16 with an fp8 cache and the features)
  // and the CUDA-core path (fp32, a window over several blocks).
  int status = prefill<__half, 64, 16>(rng, 20);
  status |= prefill<__nv_bfloat16, 80, 8, __nv_fp8_e4m3, true>(rng);
  status |= prefill<float, 64, 32>(rng, 45);
#ifdef PAGED_DRIVER_WIDE_GRID
  status |= prefill<__half, 128, 32, __nv_fp8_e5m2, true>(rng, 33);
  status |= prefill<float, 96, 16, float, true>(rng);
  status |= prefill<__nv_bfloat16, 112, 16>(rng);
#endif
  return status;
}

}  // namespace
