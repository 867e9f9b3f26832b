// Sanitizer scenarios of kernels_cu/decode_v3.cuh, included by sanitizer_driver.cpp: GQA groups in
// one CTA and in head chunks, one split (the output written directly) and several (merged; 130 under ASan), a
// sliding window with the table entries before each row's window stale, fp8 with the features,
// K/V pipelines 2 to 8 stages deep (8 a tile of table chunks ahead of the last tile); and a grid
// with more splits than the scratch holds (a plan the host refuses), whose extra CTAs must write
// nothing. Buffers are exactly sized; shared memory follows paged/kernels/v3_layout.py's
// `v3_shared_memory`.
#pragma once

namespace {

template <typename T, typename CACHE_T, int HEAD, int BLOCK, int GT, int STAGES, bool FEATURES = false>
int v3(std::mt19937& rng, const std::vector<int>& seq_lens, int group, int splits, int sliding_window = 0,
       int scratch_splits = 0) {
  typedef paged::V3Layout<CACHE_T, HEAD, GT, STAGES> Layout;
  const int num_seqs = int(seq_lens.size()), num_kv_heads = 2, num_heads = num_kv_heads * group;
  const int max_len = seq_lens.back();  // the last row is the longest: its table row ends the buffer
  const int max_blocks = paged::div_up(max_len, BLOCK);
  const int span_blocks = sliding_window > 0 ? paged::div_up(std::min(max_len, sliding_window + BLOCK - 1), BLOCK)
                                             : max_blocks;
  const int tile_blocks = paged::V3_TILE / BLOCK;
  const int tiles_per_split = paged::div_up(paged::div_up(span_blocks, tile_blocks), splits);
  const int split_blocks = tiles_per_split * tile_blocks;
  scratch_splits = scratch_splits > 0 ? scratch_splits : splits;
  const int num_blocks = max_blocks + 2;
  std::vector<CACHE_T> k = random_values<CACHE_T>(std::size_t(num_blocks) * num_kv_heads * HEAD * BLOCK, rng);
  std::vector<CACHE_T> v = random_values<CACHE_T>(k.size(), rng);
  const std::size_t q_size = std::size_t(num_seqs) * num_heads * HEAD;
  std::vector<T> q = random_values<T>(q_size, rng), out(q_size);
  std::vector<int> tables(std::size_t(num_seqs) * max_blocks);
  for (std::size_t i = 0; i < tables.size(); ++i) tables[i] = int(rng() % num_blocks);
  tables.back() = num_blocks - 1;
  for (int seq = 0; seq < num_seqs; ++seq) {
    const int first_block = paged::window_start(seq_lens[seq], sliding_window) / BLOCK;
    for (int b = 0; b < first_block; ++b) tables[std::size_t(seq) * max_blocks + b] = kStaleBlock;
  }
  const bool partial = splits > 1;
  std::vector<float> lse(partial ? std::size_t(num_seqs) * num_heads * scratch_splits : 0);
  std::vector<float> tmp_out(lse.size() * HEAD);
  FeatureArgs<CACHE_T, BLOCK, FEATURES> features(num_heads, num_kv_heads);

  T* out_p = out.data();
  float* lse_p = partial ? lse.data() : nullptr;
  float* tmp_p = partial ? tmp_out.data() : nullptr;
  const T* q_p = q.data();
  const CACHE_T *k_p = k.data(), *v_p = v.data();
  const int *tables_p = tables.data(), *lens_p = seq_lens.data();
  int heads = num_heads, kv_heads = num_kv_heads, blocks_per_seq = max_blocks, q_stride = num_heads * HEAD;
  int block_stride = num_kv_heads * HEAD * BLOCK, head_stride = HEAD * BLOCK, window = sliding_window;
  int split_blocks_arg = split_blocks, capacity = partial ? scratch_splits : 1, block = BLOCK;
  float scale = 1.0f / std::sqrt(float(HEAD));
  void* args[] = {&out_p,       &lse_p,  &tmp_p,           &q_p,      &k_p,          &v_p,
                  &heads,       &kv_heads, &scale,         &tables_p, &lens_p,       &blocks_per_seq,
                  &q_stride,    &block_stride, &head_stride, &window, &split_blocks_arg, &capacity,
                  FEATURE_ARG_PTRS(features)};
  const unsigned chunks = unsigned(paged::div_up(group, GT));
  LaunchDims dims{{num_kv_heads * chunks, unsigned(num_seqs), unsigned(splits)}, {paged::V3_THREADS, 1, 1},
                  static_cast<unsigned long long>(Layout::BYTES)};
  int status = run(paged_emu::launch(&paged::paged_attention_v3_kernel<T, CACHE_T, HEAD, BLOCK, GT, STAGES, FEATURES>,
                                     dims, args), "v3");
  if (partial) {
    void* merge_args[] = {&out_p, &lse_p, &tmp_p, &lens_p, &block, &split_blocks_arg, &capacity, &window};
    LaunchDims merge{{unsigned(num_heads), unsigned(num_seqs), 1}, {paged::V3_THREADS, 1, 1}, 0};
    status |= run(paged_emu::launch(&paged::paged_attention_v3_merge_kernel<T, HEAD>, merge, merge_args), "v3 merge");
  }
  return status;
}

inline int v3_scenarios(std::mt19937& rng) {
  // Three splits merged; the group of 8 with a window over stale blocks in one split; fp8 with the
  // features in two splits, 6 stages deep (an H100's depth for them); six splits launched over a
  // scratch of four; 8 stages over one split longer than a table chunk.
  int status = v3<__half, __half, 64, 16, 4, 3>(rng, {5, 40, 300}, 4, 3);
  status |= v3<float, float, 64, 32, 8, 2>(rng, {1, 90, 200}, 8, 1, 45);
  status |= v3<__nv_bfloat16, __nv_fp8_e4m3, 80, 8, 2, 6, true>(rng, {33, 150}, 2, 2, 70);
  status |= v3<__half, __half, 64, 16, 1, 3>(rng, {17, 400}, 1, 6, 0, 4);
  status |= v3<__half, __nv_fp8_e4m3, 64, 8, 4, 8>(rng, {3, 1100}, 4, 1);
#ifdef PAGED_DRIVER_WIDE_GRID
  // 130 splits of one tile over the 129 of the longer row (the last split empty in both rows, the
  // short row's trailing ones too), merged in parallel over the splits: ASan only, as it would
  // add 70% to TSan's run, and the merge's barriers are the same at 3 splits.
  status |= v3<__half, __half, 64, 16, 4, 3>(rng, {3, 4100}, 4, 130);
  status |= v3<__half, __nv_fp8_e5m2, 128, 16, 8, 6, true>(rng, {64, 520}, 8, 4, 300);
  status |= v3<float, float, 256, 32, 8, 2>(rng, {9, 130}, 16, 2);
  status |= v3<__nv_bfloat16, __nv_bfloat16, 96, 8, 4, 4>(rng, {2, 257}, 3, 5);
  status |= v3<__half, __half, 112, 32, 2, 5, true>(rng, {1, 1000}, 2, 7, 100);
#endif
  return status;
}

}  // namespace
