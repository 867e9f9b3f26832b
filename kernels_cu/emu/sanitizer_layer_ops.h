// Sanitizer scenarios of kernels_cu/layer_ops.cuh, included by sanitizer_driver.cpp: every layer
// kernel in each activation dtype and both load widths (16-byte vectors and single elements), on
// buffers of exactly the size a launch may touch. Rows sit at a stride wider than their width and
// the last one ends at its buffer's end, RoPE's last row reads the tables' last position, and a
// block has two warps and fewer threads than a row has loads, so the row loops wrap.
#pragma once

namespace {

constexpr unsigned kLayerThreads = 64;
constexpr int kLayerRows = 3;

// Elements from the first row's start to the end of the last row's `width` elements.
inline std::size_t rows_extent(int stride, int width) { return std::size_t(kLayerRows - 1) * stride + width; }

// rms_norm, add_rms_norm and silu_and_mul over rows of `hidden` (silu's input rows 2 * hidden).
template <typename T, int VEC>
int layer_row_ops(std::mt19937& rng, int hidden) {
  const LaunchDims dims{{unsigned(kLayerRows), 1, 1}, {kLayerThreads, 1, 1}, 0};
  // A stride VEC wider than the row keeps every row start a whole number of vectors in.
  int stride = hidden + VEC, width = hidden, wide_stride = 2 * hidden + VEC;
  float eps = 1e-5f;
  std::vector<T> x = random_values<T>(rows_extent(stride, hidden), rng);
  std::vector<T> residual = random_values<T>(x.size(), rng);
  std::vector<T> weight = random_values<T>(std::size_t(hidden), rng);
  std::vector<T> out(x.size());
  std::vector<T> gate_up = random_values<T>(rows_extent(wide_stride, 2 * hidden), rng);
  T *x_p = x.data(), *residual_p = residual.data(), *out_p = out.data();
  const T *x_c = x_p, *weight_c = weight.data(), *gate_up_c = gate_up.data();

  void* norm_args[] = {&out_p, &x_c, &weight_c, &stride, &stride, &width, &eps};
  int status = run(paged_emu::launch(&paged::rms_norm_kernel<T, VEC>, dims, norm_args), "rms_norm");
  void* add_args[] = {&x_p, &residual_p, &weight_c, &stride, &stride, &width, &eps};
  status |= run(paged_emu::launch(&paged::add_rms_norm_kernel<T, VEC>, dims, add_args), "add_rms_norm");
  void* silu_args[] = {&out_p, &gate_up_c, &stride, &wide_stride, &width};
  status |= run(paged_emu::launch(&paged::silu_and_mul_kernel<T, VEC>, dims, silu_args), "silu_and_mul");
  return status;
}

// RoPE on the q and k heads of a fused qkv row (v's head past them is not touched, and the last
// row's buffer ends where its k head does).
template <typename T>
int layer_rope(std::mt19937& rng) {
  const LaunchDims dims{{unsigned(kLayerRows), 1, 1}, {kLayerThreads, 1, 1}, 0};
  int head_dim = 96, num_heads = 3, row_stride = 4 * 96;  // q, q, k rotated; v left
  const int num_positions = 7;
  std::vector<T> qk = random_values<T>(rows_extent(row_stride, num_heads * head_dim), rng);
  std::vector<T> cos_table = random_values<T>(std::size_t(num_positions) * head_dim, rng);
  std::vector<T> sin_table = random_values<T>(cos_table.size(), rng);
  std::vector<paged::int64> positions = {3, 0, num_positions - 1};
  T* qk_p = qk.data();
  const paged::int64* positions_p = positions.data();
  const T *cos_p = cos_table.data(), *sin_p = sin_table.data();
  void* args[] = {&qk_p, &positions_p, &cos_p, &sin_p, &row_stride, &num_heads, &head_dim};
  return run(paged_emu::launch(&paged::rotary_embedding_kernel<T>, dims, args), "rotary_embedding");
}

template <typename T>
int layer_ops(std::mt19937& rng) {
  constexpr int kVec = 16 / sizeof(T);
  // 80 vectors and 101 elements a row: more loads than the block's 64 threads.
  return layer_row_ops<T, kVec>(rng, 80 * kVec) | layer_row_ops<T, 1>(rng, 101) | layer_rope<T>(rng);
}

}  // namespace

inline int layer_ops_scenarios(std::mt19937& rng) {
  return layer_ops<float>(rng) | layer_ops<__half>(rng) | layer_ops<__nv_bfloat16>(rng);
}
