// Sanitizer driver: runs kernel configurations through the emulator runtime so a sanitizer can watch
// every access the kernels make. Built with ThreadSanitizer (tests/test_kernels_tsan.py: the barriers
// and shuffles order every shared-memory access) or with AddressSanitizer + UndefinedBehaviorSanitizer
// (tests/test_kernels_asan.py: every global and shared-memory access stays inside its buffer, the
// CPU counterpart of compute-sanitizer memcheck). Built as an executable (a sanitizer runtime must
// start before any thread exists, which a library loaded into Python cannot promise).
// Exit status 0 means every launch ran; sanitizer reports go to stderr with a non-zero exit status.
//
// Planted defects, each a #define before this file is included, prove that a check can fail:
//   PAGED_TEST_DROP_BARRIER (attention.cuh) removes a __syncthreads, so TSan must report a race.
//   PAGED_TEST_OOB_BLOCK_TABLE (here) makes the caller's block table one block narrower than the
//     longest (last) sequence needs, so the kernel reads past the table and ASan must report it.
//   PAGED_TEST_MISALIGNED_QUERY (here) passes a query that starts one element into its buffer, so
//     the kernel's vector loads of it are misaligned (a GPU faults) and UBSan must report it.
//   PAGED_TEST_NO_SPLIT_GUARD (decode_v3.cuh) drops v3's check of the split index against the
//     scratch's capacity, so the launch with more splits than its scratch writes past it (ASan).
// Runs with a sliding window give the blocks wholly before each sequence's window a table entry far
// outside the caches (a stale entry may name any block), so a kernel that reads one faults. Runs
// with an fp8 cache read per-head scale arrays of exactly num_kv_heads floats; runs with the
// features read ALiBi slopes of exactly num_heads floats and skip the blocks a sparse pattern leaves
// out.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <random>
#include <vector>

#include "../paged.cu"

// GCC announces ASan with __SANITIZE_ADDRESS__, clang through __has_feature.
#if defined(__SANITIZE_ADDRESS__)
#define PAGED_DRIVER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PAGED_DRIVER_ASAN 1
#endif
#endif
// ASan's compile and run are cheap next to TSan's, so an ASan build covers every dtype, block size
// and head size while TSan keeps its short list. A planted defect stops the program at the first
// launch, so those builds skip the extra instantiations they would never reach.
#if defined(PAGED_DRIVER_ASAN) && !defined(PAGED_TEST_OOB_BLOCK_TABLE) && !defined(PAGED_TEST_MISALIGNED_QUERY) && \
    !defined(PAGED_TEST_NO_SPLIT_GUARD)
#define PAGED_DRIVER_WIDE_GRID 1
#endif
// The caller's defects and the dropped barrier show in the first attention launch (where ASan and
// UBSan stop the run), so their builds compile that launch alone: the rest is most of a build's
// time (48 of 55 s of CPU for the out-of-bounds ASan build on a 2-core EPYC) and would never run or
// add a report.
#if defined(PAGED_TEST_OOB_BLOCK_TABLE) || defined(PAGED_TEST_MISALIGNED_QUERY) || defined(PAGED_TEST_DROP_BARRIER)
#define PAGED_DRIVER_FIRST_LAUNCH_ONLY 1
#endif

namespace {

using paged_emu::LaunchDims;

template <typename T>
std::vector<T> random_values(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-0.1f, 0.1f);
  std::vector<T> values(n);
  for (T& v : values) v = paged::from_float<T>(dist(rng));
  return values;
}

// Far past the caches: a read through it leaves every mapping.
constexpr int kStaleBlock = 1 << 28;

int run(int status, const char* what) {
  if (status != 0) std::fprintf(stderr, "launch of %s failed with %d\n", what, status);
  return status;
}

// The attention kernels' FEATURE_PARAMS, with buffers of exactly the size a kernel may read: per-KV-head
// fp8 scales (passed only for an fp8 cache), per-head ALiBi slopes and a sparse pattern of two cache
// blocks (both only with the features). Launches pass the addresses of the `args` members.
template <typename CACHE_T, int BLOCK, bool FEATURES>
struct FeatureArgs {
  FeatureArgs(int num_heads, int num_kv_heads)
      : k_scale_values(num_kv_heads, 0.5f), v_scale_values(num_kv_heads, 0.25f), slope_values(num_heads, -0.125f),
        k_scales(sizeof(CACHE_T) == 1 ? k_scale_values.data() : nullptr),
        v_scales(sizeof(CACHE_T) == 1 ? v_scale_values.data() : nullptr),
        slopes(FEATURES ? slope_values.data() : nullptr) {}
  std::vector<float> k_scale_values, v_scale_values, slope_values;
  const float *k_scales, *v_scales, *slopes;
  int bs_block = 2 * BLOCK, bs_local = FEATURES ? 1 : 0, bs_stride = FEATURES ? 3 : 0, bs_step = 1;
};
// FeatureArgs `f`'s members in FEATURE_PARAMS order, for a launch's argument array.
#define FEATURE_ARG_PTRS(f) &f.k_scales, &f.v_scales, &f.slopes, &f.bs_block, &f.bs_local, &f.bs_stride, &f.bs_step

// Every buffer is a std::vector of exactly the size the kernel may touch (and shared memory is sized
// by the formulas of backends/launch.py), so ASan's redzones sit right past each one.
template <typename T, typename CACHE_T, int HEAD, int BLOCK, int PARTITION, bool FEATURES>
int attention(std::mt19937& rng, const std::vector<int>& seq_lens, int sliding_window) {
  constexpr int kThreads = 128;
  const int num_seqs = int(seq_lens.size()), num_heads = 2, num_kv_heads = 1;
  // The last sequence is the longest: its row is the table's last, so reading past it leaves the buffer.
  const int max_len = seq_lens.back();
  const int max_blocks = paged::div_up(max_len, BLOCK);
  // What the launch plan sizes by: with a window, only the blocks and partitions it reaches.
  const int span = sliding_window > 0 ? std::min(max_len, sliding_window + BLOCK - 1) : max_len;
  const int partition_span = sliding_window > 0 ? std::min(max_len, sliding_window + PARTITION - 1) : max_len;
#ifdef PAGED_TEST_OOB_BLOCK_TABLE
  // The caller's defect: a table one block narrower than the longest sequence needs.
  const int table_width = max_blocks - 1;
#else
  const int table_width = max_blocks;
#endif
#ifdef PAGED_TEST_MISALIGNED_QUERY
  // The caller's defect: a query view one element into its (one element longer) buffer.
  constexpr std::size_t kQueryOffset = 1;
#else
  constexpr std::size_t kQueryOffset = 0;
#endif
  const int num_blocks = max_blocks + 2;
  std::vector<CACHE_T> k = random_values<CACHE_T>(std::size_t(num_blocks) * num_kv_heads * HEAD * BLOCK, rng);
  std::vector<CACHE_T> v = random_values<CACHE_T>(k.size(), rng);
  const std::size_t q_size = std::size_t(num_seqs) * num_heads * HEAD;
  std::vector<T> q = random_values<T>(q_size + kQueryOffset, rng);
  std::vector<int> tables(std::size_t(num_seqs) * table_width);
  for (std::size_t i = 0; i < tables.size(); ++i) tables[i] = int(rng() % num_blocks);
  // The physical block at the end of the caches is in use, so an access past a block's extent
  // leaves the K/V buffers instead of landing unnoticed in a neighbouring block.
  tables.back() = num_blocks - 1;
  for (int seq = 0; seq < num_seqs; ++seq) {
    const int first_block = paged::window_start(seq_lens[seq], sliding_window) / BLOCK;
    for (int b = 0; b < std::min(first_block, table_width); ++b) {
      tables[std::size_t(seq) * table_width + b] = kStaleBlock;
    }
  }
  std::vector<T> out(q_size);
  const int num_partitions = paged::div_up(partition_span, PARTITION);
  std::vector<float> exp_sums(std::size_t(num_seqs) * num_heads * num_partitions);
  std::vector<float> max_logits(exp_sums.size());
  std::vector<float> tmp_out(exp_sums.size() * HEAD);

  // Sparse blocks of two cache blocks: the longest sequence skips some.
  FeatureArgs<CACHE_T, BLOCK, FEATURES> features(num_heads, num_kv_heads);

  T* out_p = out.data();
  const T* q_p = q.data() + kQueryOffset;
  const CACHE_T *k_p = k.data(), *v_p = v.data();
  const int *tables_p = tables.data(), *lens_p = seq_lens.data();
  float *sums_p = exp_sums.data(), *max_p = max_logits.data(), *tmp_p = tmp_out.data();
  int kv_heads = num_kv_heads, blocks_per_seq = table_width, q_stride = num_heads * HEAD;
  int block_stride = num_kv_heads * HEAD * BLOCK, head_stride = HEAD * BLOCK, partitions = num_partitions;
  float scale = 1.0f / std::sqrt(float(HEAD));
  int window = sliding_window;
  void* common[] = {&q_p, &k_p, &v_p, &kv_heads, &scale, &tables_p, &lens_p, &blocks_per_seq,
                    &q_stride, &block_stride, &head_stride, &window, FEATURE_ARG_PTRS(features)};

  const unsigned long long outputs_smem = (kThreads / 64) * HEAD * 4;
  const unsigned long long v1_smem =
      std::max<unsigned long long>(paged::div_up(span, BLOCK) * BLOCK * 4, outputs_smem);
  void* v1_args[20] = {&out_p};
  std::copy(std::begin(common), std::end(common), v1_args + 1);
  LaunchDims v1{{unsigned(num_heads), unsigned(num_seqs), 1}, {kThreads, 1, 1}, v1_smem};
  int status = run(
      paged_emu::launch(&paged::paged_attention_v1_kernel<T, CACHE_T, HEAD, BLOCK, kThreads, FEATURES>, v1, v1_args),
      "v1");

  void* v2_args[22] = {&sums_p, &max_p, &tmp_p};
  std::copy(std::begin(common), std::end(common), v2_args + 3);
  LaunchDims v2{{unsigned(num_heads), unsigned(num_seqs), unsigned(num_partitions)},
                {kThreads, 1, 1},
                std::max<unsigned long long>(PARTITION * 4, outputs_smem)};
  status |= run(paged_emu::launch(&paged::paged_attention_v2_kernel<T, CACHE_T, HEAD, BLOCK, kThreads, PARTITION, FEATURES>,
                                  v2, v2_args),
                "v2");

  const float *sums_c = sums_p, *max_c = max_p, *tmp_c = tmp_p;
  void* reduce_args[] = {&out_p, &sums_c, &max_c, &tmp_c, &lens_p, &partitions, &window};
  LaunchDims reduce{{unsigned(num_heads), unsigned(num_seqs), 1}, {kThreads, 1, 1},
                    (unsigned long long)num_partitions * 4};
  status |= run(paged_emu::launch(&paged::paged_attention_v2_reduce_kernel<T, HEAD, kThreads, PARTITION>, reduce,
                                  reduce_args),
                "v2 reduce");
  return status;
}

// A short sequence and one spanning several partitions, the last one partial.
template <typename T, int HEAD, int BLOCK, int PARTITION, typename CACHE_T = T, bool FEATURES = false>
int attention(std::mt19937& rng, int sliding_window = 0) {
#ifdef PAGED_DRIVER_WIDE_GRID
  // Plus the edges: a single token, and a sequence filling exactly one partition of whole blocks.
  const std::vector<int> seq_lens = {1, PARTITION, BLOCK + 1, 2 * PARTITION + 3};
#else
  const std::vector<int> seq_lens = {BLOCK + 1, 2 * PARTITION + 3};
#endif
  return attention<T, CACHE_T, HEAD, BLOCK, PARTITION, FEATURES>(rng, seq_lens, sliding_window);
}

template <typename T, typename CACHE_T = T>
int cache_ops(std::mt19937& rng) {
  const int num_tokens = 3, num_heads = 2, head = 64, block = 16, num_blocks = 4, x = 16 / sizeof(CACHE_T);
  std::vector<T> key = random_values<T>(std::size_t(num_tokens) * num_heads * head, rng);
  std::vector<T> value = random_values<T>(key.size(), rng);
  std::vector<CACHE_T> key_cache(std::size_t(num_blocks) * num_heads * head * block);
  std::vector<CACHE_T> value_cache(key_cache.size());
  std::vector<float> k_scales(num_heads, 0.5f), v_scales(num_heads, 0.25f);
  const bool fp8 = sizeof(CACHE_T) == 1;
  const float *k_scales_p = fp8 ? k_scales.data() : nullptr, *v_scales_p = fp8 ? v_scales.data() : nullptr;
  // The last slot of the cache is written, so a layout off by one leaves the buffer.
  std::vector<paged::int64> slots = {5, -1, num_blocks * block - 1};
  const T *key_p = key.data(), *value_p = value.data();
  CACHE_T *kc_p = key_cache.data(), *vc_p = value_cache.data();
  const paged::int64* slots_p = slots.data();
  int stride = num_heads * head, heads = num_heads, head_size = head, block_size = block, xx = x;
  void* write_args[] = {&key_p, &value_p, &kc_p,       &vc_p,       &slots_p,   &stride, &stride,
                        &heads, &head_size, &block_size, &xx, &k_scales_p, &v_scales_p};
  LaunchDims write{{unsigned(num_tokens), 1, 1}, {128, 1, 1}, 0};
  int status =
      run(paged_emu::launch(&paged::reshape_and_cache_kernel<T, CACHE_T>, write, write_args), "reshape_and_cache");

  std::vector<paged::int64> key_ptrs = {paged::int64(kc_p)}, value_ptrs = {paged::int64(vc_p)};
  std::vector<paged::int64> mapping = {0, 2, 1, 3};
  const paged::int64 *kp = key_ptrs.data(), *vp = value_ptrs.data(), *mp = mapping.data();
  int numel = num_heads * head * block;
  void* copy_args[] = {&kp, &vp, &mp, &numel};
  LaunchDims copy{{1, 2, 1}, {256, 1, 1}, 0};
  status |= run(paged_emu::launch(&paged::copy_blocks_kernel<CACHE_T>, copy, copy_args), "copy_blocks");
  return status;
}

}  // namespace

#include "sanitizer_layer_ops.h"
#include "sanitizer_prefill.h"
#include "sanitizer_v3.h"

int main() {
  std::mt19937 rng(0);
  int status = 0;
  // The missing split guard is v3's alone: its build runs only v3, sparing a compile of the rest.
#ifndef PAGED_TEST_NO_SPLIT_GUARD
  status |= attention<__half, 64, 16, 32>(rng);
#ifndef PAGED_DRIVER_FIRST_LAUNCH_ONLY
  status |= attention<__nv_bfloat16, 80, 8, 32>(rng);
  status |= attention<float, 64, 32, 64>(rng);
  status |= cache_ops<__half>(rng);
  // An fp8 cache with ALiBi and a block-sparse pattern, and the fp8 cache write.
  status |= attention<__half, 64, 16, 32, __nv_fp8_e4m3, true>(rng);
  status |= cache_ops<__half, __nv_fp8_e4m3>(rng);
  // A window longer than a block but not a multiple of one, starting inside the second partition.
  status |= attention<__half, 64, 16, 32>(rng, 16 + 3);
#ifdef PAGED_DRIVER_WIDE_GRID
  // Windows shorter than a block, and longer than a partition.
  status |= attention<__nv_bfloat16, 80, 8, 32>(rng, 5);
  status |= attention<float, 64, 32, 64>(rng, 64 + 1);
  // Every (dtype, block size) pair and every head size of limits.py at least once, and the
  // default partition size (512).
  status |= attention<__half, 128, 8, 512>(rng);
  status |= attention<__half, 256, 32, 64>(rng);
  status |= attention<__nv_bfloat16, 112, 16, 64>(rng);
  status |= attention<__nv_bfloat16, 96, 32, 128>(rng);
  status |= attention<float, 96, 8, 32>(rng);
  status |= attention<float, 128, 16, 512>(rng);
  status |= cache_ops<__nv_bfloat16>(rng);
  status |= cache_ops<float>(rng);
  status |= attention<float, 128, 8, 64, __nv_fp8_e5m2, true>(rng, 64 + 1);
  status |= attention<__nv_bfloat16, 96, 32, 128, __nv_fp8_e4m3>(rng);
  status |= attention<__nv_bfloat16, 64, 16, 32, __nv_bfloat16, true>(rng);
  status |= cache_ops<float, __nv_fp8_e5m2>(rng);
#endif
  status |= layer_ops_scenarios(rng);
  status |= prefill_scenarios(rng);
#endif
#endif
#ifndef PAGED_DRIVER_FIRST_LAUNCH_ONLY
  status |= v3_scenarios(rng);
#endif
  std::puts(status == 0 ? "sanitizer driver: all launches ran" : "sanitizer driver: a launch failed");
  return status;
}
