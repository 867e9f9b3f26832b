// ThreadSanitizer driver: runs a few kernel configurations through the emulator runtime so TSan can
// check that the barriers and shuffles order every shared-memory access. Built as an executable
// (TSan must start before any thread exists, which a library loaded into Python cannot promise).
// Exit status 0 means every launch ran; TSan reports races on stderr and exits with 66.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <random>
#include <vector>

#include "../paged.cu"

namespace {

using paged_emu::LaunchDims;

template <typename T>
std::vector<T> random_values(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-0.1f, 0.1f);
  std::vector<T> values(n);
  for (T& v : values) v = paged::from_float<T>(dist(rng));
  return values;
}

int run(int status, const char* what) {
  if (status != 0) std::fprintf(stderr, "launch of %s failed with %d\n", what, status);
  return status;
}

template <typename T, int HEAD, int BLOCK, int PARTITION>
int attention(std::mt19937& rng) {
  constexpr int kThreads = 128;
  const int num_seqs = 2, num_heads = 2, num_kv_heads = 1;
  const std::vector<int> seq_lens = {BLOCK + 1, 2 * PARTITION + 3};
  const int max_len = seq_lens[1];
  const int max_blocks = paged::div_up(max_len, BLOCK);
  const int num_blocks = max_blocks + 2;
  std::vector<T> k = random_values<T>(std::size_t(num_blocks) * num_kv_heads * HEAD * BLOCK, rng);
  std::vector<T> v = random_values<T>(k.size(), rng);
  std::vector<T> q = random_values<T>(std::size_t(num_seqs) * num_heads * HEAD, rng);
  std::vector<int> tables(std::size_t(num_seqs) * max_blocks);
  for (std::size_t i = 0; i < tables.size(); ++i) tables[i] = int(rng() % num_blocks);
  std::vector<T> out(q.size());
  const int num_partitions = paged::div_up(max_len, PARTITION);
  std::vector<float> exp_sums(std::size_t(num_seqs) * num_heads * num_partitions);
  std::vector<float> max_logits(exp_sums.size());
  std::vector<float> tmp_out(exp_sums.size() * HEAD);

  T* out_p = out.data();
  const T *q_p = q.data(), *k_p = k.data(), *v_p = v.data();
  const int *tables_p = tables.data(), *lens_p = seq_lens.data();
  float *sums_p = exp_sums.data(), *max_p = max_logits.data(), *tmp_p = tmp_out.data();
  int kv_heads = num_kv_heads, blocks_per_seq = max_blocks, q_stride = num_heads * HEAD;
  int block_stride = num_kv_heads * HEAD * BLOCK, head_stride = HEAD * BLOCK, partitions = num_partitions;
  float scale = 1.0f / std::sqrt(float(HEAD));
  void* common[] = {&q_p, &k_p, &v_p, &kv_heads, &scale, &tables_p, &lens_p, &blocks_per_seq,
                    &q_stride, &block_stride, &head_stride};

  const unsigned long long outputs_smem = (kThreads / 64) * HEAD * 4;
  const unsigned long long v1_smem = std::max<unsigned long long>(max_blocks * BLOCK * 4, outputs_smem);
  void* v1_args[12] = {&out_p};
  std::copy(std::begin(common), std::end(common), v1_args + 1);
  LaunchDims v1{{unsigned(num_heads), unsigned(num_seqs), 1}, {kThreads, 1, 1}, v1_smem};
  int status = run(paged_emu::launch(&paged::paged_attention_v1_kernel<T, HEAD, BLOCK, kThreads>, v1, v1_args), "v1");

  void* v2_args[14] = {&sums_p, &max_p, &tmp_p};
  std::copy(std::begin(common), std::end(common), v2_args + 3);
  LaunchDims v2{{unsigned(num_heads), unsigned(num_seqs), unsigned(num_partitions)},
                {kThreads, 1, 1},
                std::max<unsigned long long>(PARTITION * 4, outputs_smem)};
  status |= run(paged_emu::launch(&paged::paged_attention_v2_kernel<T, HEAD, BLOCK, kThreads, PARTITION>, v2, v2_args),
                "v2");

  const float *sums_c = sums_p, *max_c = max_p, *tmp_c = tmp_p;
  void* reduce_args[] = {&out_p, &sums_c, &max_c, &tmp_c, &lens_p, &partitions};
  LaunchDims reduce{{unsigned(num_heads), unsigned(num_seqs), 1}, {kThreads, 1, 1},
                    (unsigned long long)num_partitions * 4};
  status |= run(paged_emu::launch(&paged::paged_attention_v2_reduce_kernel<T, HEAD, kThreads, PARTITION>, reduce,
                                  reduce_args),
                "v2 reduce");
  return status;
}

template <typename T>
int cache_ops(std::mt19937& rng) {
  const int num_tokens = 3, num_heads = 2, head = 64, block = 16, num_blocks = 4, x = 16 / sizeof(T);
  std::vector<T> key = random_values<T>(std::size_t(num_tokens) * num_heads * head, rng);
  std::vector<T> value = random_values<T>(key.size(), rng);
  std::vector<T> key_cache(std::size_t(num_blocks) * num_heads * head * block);
  std::vector<T> value_cache(key_cache.size());
  std::vector<paged::int64> slots = {5, -1, 40};
  const T *key_p = key.data(), *value_p = value.data();
  T *kc_p = key_cache.data(), *vc_p = value_cache.data();
  const paged::int64* slots_p = slots.data();
  int stride = num_heads * head, heads = num_heads, head_size = head, block_size = block, xx = x;
  void* write_args[] = {&key_p, &value_p, &kc_p, &vc_p, &slots_p, &stride, &stride, &heads, &head_size, &block_size, &xx};
  LaunchDims write{{unsigned(num_tokens), 1, 1}, {128, 1, 1}, 0};
  int status = run(paged_emu::launch(&paged::reshape_and_cache_kernel<T>, write, write_args), "reshape_and_cache");

  std::vector<paged::int64> key_ptrs = {paged::int64(kc_p)}, value_ptrs = {paged::int64(vc_p)};
  std::vector<paged::int64> mapping = {0, 2, 1, 3};
  const paged::int64 *kp = key_ptrs.data(), *vp = value_ptrs.data(), *mp = mapping.data();
  int numel = num_heads * head * block;
  void* copy_args[] = {&kp, &vp, &mp, &numel};
  LaunchDims copy{{1, 2, 1}, {256, 1, 1}, 0};
  status |= run(paged_emu::launch(&paged::copy_blocks_kernel<T>, copy, copy_args), "copy_blocks");
  return status;
}

}  // namespace

int main() {
  std::mt19937 rng(0);
  int status = attention<__half, 64, 16, 32>(rng);
  status |= attention<__nv_bfloat16, 80, 8, 32>(rng);
  status |= attention<float, 64, 32, 64>(rng);
  status |= cache_ops<__half>(rng);
  std::puts(status == 0 ? "tsan driver: all launches ran" : "tsan driver: a launch failed");
  return status;
}
