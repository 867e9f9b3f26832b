// Native CPU attention over vLLM's paged KV cache (backend "cpu"): decode (here) and prefill
// (prefill.h), block swaps (swap.h), the model's fused layer ops and reshape_and_cache
// (layer_ops.h; into a cache of another float dtype: cache_convert.h), and the extern "C" entry
// points of all of them.
//
// Plain C++17 + OpenMP, no torch headers: paged/kernels/backends/cpu.py builds this file with the
// host compiler and calls the entry points through ctypes with raw data pointers. Layouts are in
// common.h; decode's query and output have one row per sequence.
//
// Work is split over (seq, kv_head); the G = num_heads / num_kv_heads query heads of a GQA group
// are handled together, so every K/V element is read from the cache once per group. Each block's
// K and V tiles are converted to fp32 into small per-thread tiles (K as [head_size][block_size],
// V as [block_size][head_size]) so the inner loops run over contiguous floats without a
// floating-point reduction in the vectorised dimension: results stay IEEE (no -ffast-math) and
// match the torch reference to ~1e-6 in fp32.
//
// v1: one softmax over the whole context (fp32 logits in a per-thread buffer).
// v2: partitions of partition_size tokens, each with its max logit, exp-sum and normalised partial
//     output; then the partials are rescaled by exp(max_p - max) * sum_p and reduced
//     (the math of torch_ref.paged_attention_v2).
// v3 (decode_v3.h): one online-softmax pass per (seq, kv_head, KV split) of a per-step split plan,
//     the splits merged by log-sum-exp.
// With a sliding window both start at the window's first block (v2: at the partition holding it)
// and never read the blocks before it.
//
// The features (paged/kernels/features.py) branch per block, never per element: an fp8 cache is
// dequantised as its tiles are converted to fp32 (value * the KV head's scale), ALiBi adds
// slope * (key - query position) to a block's logits, and block-sparse attention gives -inf
// logits to a block a head does not see and skips reading one that no head of the group sees
// (as vLLM's kernel does). A v2 partition may then hold nothing a head sees: its max logit stays
// -inf and its weight 0.

#include "argmax.h"
#include "attention_mass.h"
#include "cache_convert.h"
#include "common.h"
#include "decode_v3.h"
#include "gemm_packed.h"
#include "layer_ops.h"
#include "prefill.h"
#include "slots.h"
#include "swap.h"

namespace paged_cpu {

// Per-thread scratch, sized once per call.
struct Scratch {
  std::vector<float> q;        // [D]: one query head
  std::vector<float> qx;       // [G][D/x][BS][x]: each head's query chunk repeated for every slot
  std::vector<float> kt, vt;   // fp32 copies of one block's K and V tiles (not for an fp32 cache's K)
  std::vector<float> logits;   // v1: [G][max_len]; v2: [G][partition_size]
  std::vector<float> vacc;     // [G][D][BS]: per-slot partial sums of the weighted values
  std::vector<float> acc;      // [G][D]
  std::vector<float> part_max, part_sum, part_out;  // v2: [G][P], [G][P], [G][P][D]
  std::vector<float> weights;  // v1: per-head exp-sums [G]; v2: partition weights [P]
  std::vector<char> sees;      // block-sparse: [G] whether each head sees the current block

  void init(int G, int D, int BS, int64_t logits_len) {
    q.resize(D);
    sees.resize(G);
    qx.resize(static_cast<size_t>(G) * D * BS);
    kt.resize(static_cast<size_t>(D) * BS);
    vt.resize(static_cast<size_t>(D) * BS);
    logits.resize(static_cast<size_t>(G) * logits_len);
    vacc.resize(static_cast<size_t>(G) * D * BS);
    acc.resize(static_cast<size_t>(G) * D);
  }
};

// Query of the G heads from `head0`, laid out like a key tile ([D/x][BS][x], x of the cache) with
// each x-chunk repeated for every slot, so a block's logits are one elementwise multiply-add over
// the K tile.
template <typename C, int BS_T>
inline void load_query(const Args& a, int seq, int head0, int G, Scratch& s) {
  constexpr int x = x_of<C>();
  const int BS = BS_T, D = a.head_size;
  for (int g = 0; g < G; ++g) {
    load_query_row(a, seq * a.q_stride_seq + (head0 + g) * a.q_stride_head, D, s.q.data());
    float* dst = s.qx.data() + static_cast<int64_t>(g) * D * BS;
    for (int c = 0; c < D / x; ++c)
      for (int off = 0; off < BS; ++off)
        for (int i = 0; i < x; ++i) dst[(c * BS + off) * x + i] = s.q[c * x + i];
  }
}

// logits[g][off] = scale * q[g] . k[off] for off < valid, reading the K tile in cache order.
template <typename C, int BS_T>
inline void block_logits(const Args& a, int G, const typename C::storage* k, float k_scale, Scratch& s, int valid,
                         float* logits, int64_t logits_stride) {
  constexpr int x = x_of<C>();
  const int BS = BS_T, D = a.head_size;
  const int n = D * BS;
  const float* kf;
  if constexpr (std::is_same_v<C, F32>) {
    kf = k;
  } else {
    for (int j = 0; j < n; ++j) s.kt[j] = dequant<C>(k[j], k_scale);
    kf = s.kt.data();
  }
  const int chunk = BS * x;
  float part[BS_T * x];  // [BS][x]
  for (int g = 0; g < G; ++g) {
    const float* q = s.qx.data() + static_cast<int64_t>(g) * n;
    for (int j = 0; j < chunk; ++j) part[j] = 0.f;
    for (int c = 0; c < D / x; ++c) {
      const float* qc = q + c * chunk;
      const float* kc = kf + c * chunk;
      for (int j = 0; j < chunk; ++j) part[j] += qc[j] * kc[j];
    }
    float* lg = logits + g * logits_stride;
    for (int off = 0; off < valid; ++off) {
      float dot = 0.f;
      for (int i = 0; i < x; ++i) dot += part[off * x + i];
      lg[off] = dot * a.scale;
    }
  }
}

// vacc[g][d][off] += w[g][off] * v[d][off] for lo <= off < valid (other slots contribute nothing,
// even where the cache holds NaN there).
template <typename C, int BS_T>
inline void block_values(const Args& a, int G, const typename C::storage* v, float v_scale, Scratch& s, int lo,
                         int valid, const float* w, int64_t w_stride) {
  const int BS = BS_T, D = a.head_size;
  const bool whole = lo == 0 && valid == BS;
  const float* vf;
  if (std::is_same_v<C, F32> && whole) {
    vf = reinterpret_cast<const float*>(v);
  } else {
    if (whole) {  // most blocks: one straight loop, which vectorises (the masked one does not)
      for (int j = 0; j < D * BS; ++j) s.vt[j] = dequant<C>(v[j], v_scale);
    } else {
      for (int d = 0; d < D; ++d)
        for (int off = 0; off < BS; ++off)
          s.vt[d * BS + off] = off >= lo && off < valid ? dequant<C>(v[d * BS + off], v_scale) : 0.f;
    }
    vf = s.vt.data();
  }
  float p[BS_T];
  for (int g = 0; g < G; ++g) {
    const float* wg = w + g * w_stride;
    for (int off = 0; off < BS; ++off) p[off] = off >= lo && off < valid ? wg[off] : 0.f;
    float* acc = s.vacc.data() + static_cast<int64_t>(g) * D * BS;
    for (int d = 0; d < D; ++d)
      for (int off = 0; off < BS; ++off) acc[d * BS + off] += p[off] * vf[d * BS + off];
  }
}

// acc[g][d] = sum_off vacc[g][d][off] * inv[g]; clears vacc.
inline void reduce_values(int G, int D, int BS, Scratch& s, const float* inv) {
  for (int g = 0; g < G; ++g) {
    float* src = s.vacc.data() + static_cast<int64_t>(g) * D * BS;
    for (int d = 0; d < D; ++d) {
      float sum = 0.f;
      for (int off = 0; off < BS; ++off) sum += src[d * BS + off];
      s.acc[g * D + d] = sum * inv[g];
    }
    std::fill(src, src + static_cast<int64_t>(D) * BS, 0.f);
  }
}

// Softmax numerator over `n` logits in place: returns the max, writes exp(l - max), sets the sum.
// Logits all -inf (a v2 partition a head sees nothing of, block-sparse) give zeros and max -inf.
inline float exp_in_place(float* l, int n, float* sum_out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float m = kNegInf;
  for (int i = 0; i < n; ++i) m = l[i] > m ? l[i] : m;
  const float shift = m == kNegInf ? 0.f : m;
  float s = 0.f;
  for (int i = 0; i < n; ++i) {
    l[i] = std::exp(l[i] - shift);
    s += l[i];
  }
  *sum_out = s;
  return m;
}

// Runs `body(s, seq, kvh, L, table)` for every (sequence, KV head) with L > 0 tokens, in parallel,
// each OpenMP thread with its own scratch from `init`; `body` leaves the G query heads' output in
// s.acc. Empty sequences get zeros.
template <typename C, int BS_T, typename Init, typename Body>
void for_each_kv_head(const Args& a, Init init, Body body) {
  const int G = a.num_heads / a.num_kv_heads;
#pragma omp parallel num_threads(a.num_threads)
  {
    Scratch s;
    init(s);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int seq = 0; seq < a.num_seqs; ++seq) {
      for (int kvh = 0; kvh < a.num_kv_heads; ++kvh) {
        const int L = std::min(a.seq_lens[seq], a.max_seq_len);  // never past the scratch buffers
        const int head0 = kvh * G;
        if (L <= 0) {
          std::fill(s.acc.begin(), s.acc.end(), 0.f);
        } else {
          load_query<C, BS_T>(a, seq, head0, G, s);
          body(s, seq, kvh, L, a.block_tables + seq * a.bt_stride);
        }
        store_out_row(a, (static_cast<int64_t>(seq) * a.num_heads + head0) * a.head_size, G * a.head_size,
                      s.acc.data());
      }
    }
  }
}

// Softmax attention of the G query heads of KV head `kvh` (their query at `query_pos`) over the
// `n` positions from `start` (a block boundary) that `table`, the sequence's block table, points
// at, less the first `skip` (before the window, in its first block): the normalised output goes
// to s.acc, each head's max logit and exp-sum to max_out / sum_out (stride `out_stride`) when
// given. `stride` is the logits row length in the scratch.
template <typename C, int BS_T>
void attend_span(const Args& a, Scratch& s, int kvh, const int32_t* table, int query_pos, int start, int skip, int n,
                 int stride, float* max_out, float* sum_out, int out_stride) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int G = a.num_heads / a.num_kv_heads, bs = a.block_size, head0 = kvh * G;
  const int nb = (n + bs - 1) / bs;
  const float k_scale = kv_scale(a.k_scale, kvh), v_scale = kv_scale(a.v_scale, kvh);
  for (int b = 0; b < nb; ++b) {
    const int pos = start + b * bs, valid = std::min(bs, n - b * bs);
    float* logits = s.logits.data() + b * bs;
    const bool seen = !a.sparse.on() || a.sparse.mark_group(s.sees.data(), query_pos, pos, head0, G);
    if (seen) {
      block_logits<C, BS_T>(a, G, tile_ptr<C>(a.key_cache, a, table[pos / bs], kvh), k_scale, s, valid, logits,
                            stride);
    }
    for (int g = 0; g < G; ++g) {
      float* lg = logits + g * stride;
      if (a.sparse.on() && !s.sees[g]) {
        std::fill(lg, lg + valid, kNegInf);
      } else if (a.alibi_slopes) {
        add_alibi(lg, valid, a.alibi_slopes[head0 + g], pos - query_pos);
      }
    }
  }
  float* inv_sum = s.weights.data();
  for (int g = 0; g < G; ++g) {
    float* logits = s.logits.data() + g * stride;
    std::fill(logits, logits + skip, kNegInf);
    float sum;
    const float m = exp_in_place(logits, n, &sum);
    if (max_out) {
      max_out[g * out_stride] = m;
      sum_out[g * out_stride] = sum;
    }
    inv_sum[g] = 1.f / std::max(sum, 1e-30f);
  }
  for (int b = 0; b < nb; ++b) {
    const int pos = start + b * bs;
    if (a.sparse.on() && !a.sparse.mark_group(s.sees.data(), query_pos, pos, head0, G)) continue;
    block_values<C, BS_T>(a, G, tile_ptr<C>(a.value_cache, a, table[pos / bs], kvh), v_scale, s, b == 0 ? skip : 0,
                          std::min(bs, n - b * bs), s.logits.data() + b * bs, stride);
  }
  reduce_values(G, a.head_size, bs, s, inv_sum);
}

template <typename C, int BS_T>
void run_v1(const Args& a) {
  const int G = a.num_heads / a.num_kv_heads;
  auto init = [&](Scratch& s) {
    s.init(G, a.head_size, a.block_size, a.max_seq_len);
    s.weights.resize(G);
  };
  for_each_kv_head<C, BS_T>(a, init, [&](Scratch& s, int, int kvh, int L, const int32_t* table) {
    const int first = window_start(a, L - 1), start = first / a.block_size * a.block_size;
    attend_span<C, BS_T>(a, s, kvh, table, L - 1, start, first - start, L - start, a.max_seq_len, nullptr, nullptr,
                         0);
  });
}

template <typename C, int BS_T>
void run_v2(const Args& a) {
  const int G = a.num_heads / a.num_kv_heads, D = a.head_size;
  const int PS = a.partition_size;
  const int P_max = (a.max_seq_len + PS - 1) / PS;
  auto init = [&](Scratch& s) {
    s.init(G, D, a.block_size, PS);
    s.part_max.resize(static_cast<size_t>(G) * P_max);
    s.part_sum.resize(static_cast<size_t>(G) * P_max);
    s.part_out.resize(static_cast<size_t>(G) * P_max * D);
    s.weights.resize(std::max(P_max, G));
  };
  for_each_kv_head<C, BS_T>(a, init, [&](Scratch& s, int, int kvh, int L, const int32_t* table) {
    // Partitions p0 .. P - 1 reach the window; the first starts at the window's first block.
    const int first = window_start(a, L - 1), first_block_start = first / a.block_size * a.block_size;
    const int p0 = first / PS, P = (L + PS - 1) / PS;
    for (int p = p0; p < P; ++p) {
      const int start = std::max(p * PS, first_block_start);
      attend_span<C, BS_T>(a, s, kvh, table, L - 1, start, std::max(first - start, 0),
                           std::min((p + 1) * PS, L) - start, PS, s.part_max.data() + p, s.part_sum.data() + p,
                           P_max);
      for (int g = 0; g < G; ++g)
        std::copy(s.acc.begin() + g * D, s.acc.begin() + (g + 1) * D,
                  s.part_out.begin() + (static_cast<int64_t>(g) * P_max + p) * D);
    }
    // Reduce: weight_p = sum_p * exp(max_p - max) / sum over partitions of the same.
    std::fill(s.acc.begin(), s.acc.end(), 0.f);
    for (int g = 0; g < G; ++g) {
      const float* mx = s.part_max.data() + g * P_max;
      const float* sm = s.part_sum.data() + g * P_max;
      float gmax = -std::numeric_limits<float>::infinity();
      for (int p = p0; p < P; ++p) gmax = mx[p] > gmax ? mx[p] : gmax;
      float* w = s.weights.data();
      float total = 0.f;
      for (int p = p0; p < P; ++p) {
        w[p] = sm[p] * std::exp(mx[p] - gmax);
        total += w[p];
      }
      float* ag = s.acc.data() + g * D;
      for (int p = p0; p < P; ++p) {
        const float wp = w[p] / total;
        const float* src = s.part_out.data() + (static_cast<int64_t>(g) * P_max + p) * D;
        for (int d = 0; d < D; ++d) ag[d] += src[d] * wp;
      }
    }
  });
}

enum Op : int { kDecodeV1 = 1, kDecodeV2 = 2, kPrefill = 3, kDecodeV3 = 4 };

// `plan`: v3's split plan, unused by the other ops.
template <typename C, int BS>
void run_op(Op op, const Args& a, const SplitArgs& plan) {
  switch (op) {
    case kDecodeV1: run_v1<C, BS>(a); break;
    case kDecodeV2: run_v2<C, BS>(a); break;
    case kPrefill: run_prefill<C, BS>(a); break;
    case kDecodeV3: run_v3<C, BS>(a, plan); break;
  }
}

template <typename C>
int dispatch_bs(Op op, const Args& a, const SplitArgs& plan) {
  switch (a.block_size) {
    case 8: run_op<C, 8>(op, a, plan); return 0;
    case 16: run_op<C, 16>(op, a, plan); return 0;
    case 32: run_op<C, 32>(op, a, plan); return 0;
    default: return 1;
  }
}

int run(Op op, const Args& a, const SplitArgs& plan = {1, 1}) {
  if (a.block_size <= 0) return 1;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads) return 2;
  if (a.dtype != kF32 && a.dtype != kF16 && a.dtype != kBF16) return 7;
  // The cache may hold another float dtype than the query's (kernel.kv_cache_dtype): its tiles are read as
  // fp32 either way, and x is the cache element's.
  const bool fp8 = a.cache_dtype == kE4M3 || a.cache_dtype == kE5M2;
  const bool float_cache = a.cache_dtype == kF32 || a.cache_dtype == kF16 || a.cache_dtype == kBF16;
  if (fp8 ? !a.k_scale || !a.v_scale : !float_cache) return 8;
  const int x = fp8 ? 16 : a.cache_dtype == kF32 ? 4 : 8;
  if (a.head_size <= 0 || a.head_size % x) return 3;
  if (op == kDecodeV2 && (a.partition_size <= 0 || a.partition_size % a.block_size)) return 4;
  const BlockSparse& sp = a.sparse;
  if (sp.on() && (sp.local_blocks < 0 || sp.vert_stride <= 0 || sp.block_size <= 0 || sp.block_size % a.block_size))
    return 9;
  if (a.num_threads <= 0) return 6;
  if (op == kDecodeV3) {
    if (const int status = check_split_plan(a, plan)) return status;
  }
  switch (a.cache_dtype) {
    case kF32: return dispatch_bs<F32>(op, a, plan);
    case kF16: return dispatch_bs<F16>(op, a, plan);
    case kBF16: return dispatch_bs<BF16>(op, a, plan);
    case kE4M3: return dispatch_bs<E4M3>(op, a, plan);
    default: return dispatch_bs<E5M2>(op, a, plan);
  }
}

}  // namespace paged_cpu

using paged_cpu::Args;

#define PAGED_CPU_COMMON_ARGS                                                                                \
  int dtype, int cache_dtype, void *out, const void *query, int64_t q_stride_row, int64_t q_stride_head,      \
      int64_t q_stride_dim, const void *key_cache, const void *value_cache, const int32_t *block_tables,      \
      int64_t bt_stride, const int32_t *seq_lens, int num_seqs, int num_heads, int num_kv_heads,              \
      int head_size, int block_size, float scale, int sliding_window, const float *k_scale,                   \
      const float *v_scale, const float *alibi_slopes, int sparse_local_blocks, int sparse_vert_stride,       \
      int sparse_block_size, int sparse_head_sliding_step
// The leading Args fields, which PAGED_CPU_COMMON_ARGS fill.
#define PAGED_CPU_COMMON_FIELDS                                                                               \
  dtype, cache_dtype, out, query, q_stride_row, q_stride_head, q_stride_dim, key_cache, value_cache,          \
      block_tables, bt_stride, seq_lens, num_seqs, num_heads, num_kv_heads, head_size, block_size, scale,     \
      sliding_window, k_scale, v_scale, alibi_slopes,                                                          \
      {sparse_local_blocks, sparse_vert_stride, sparse_block_size, sparse_head_sliding_step}

// The entry points return 0 on success; a nonzero code names the rejected argument (see
// paged/kernels/backends/cpu.py). Decode's max_seq_len bounds its scratch buffers. An fp8 cache
// (cache_dtype 3 / 4) needs k_scale and v_scale; alibi_slopes may be null, and block-sparse
// attention is off with sparse_local_blocks 0.
extern "C" int paged_attention_cpu(PAGED_CPU_COMMON_ARGS, int version, int partition_size, int max_seq_len,
                                   int num_threads) {
  const Args a{PAGED_CPU_COMMON_FIELDS, nullptr, partition_size, max_seq_len, 0, num_threads};
  return paged_cpu::run(version == 1 ? paged_cpu::kDecodeV1 : paged_cpu::kDecodeV2, a);
}

// v3: `num_splits` splits of `split_blocks` cache blocks per (sequence, KV head), which must hold
// the blocks a row of max_seq_len attends to (13 / 14 otherwise: nothing is read or written).
extern "C" int paged_attention_v3_cpu(PAGED_CPU_COMMON_ARGS, int num_splits, int split_blocks, int max_seq_len,
                                      int num_threads) {
  const Args a{PAGED_CPU_COMMON_FIELDS, nullptr, 0, max_seq_len, 0, num_threads};
  return paged_cpu::run(paged_cpu::kDecodeV3, a, {num_splits, split_blocks});
}

extern "C" int prefill_attention_cpu(PAGED_CPU_COMMON_ARGS, const int32_t *query_start_loc, int max_query_len,
                                     int num_threads) {
  const Args a{PAGED_CPU_COMMON_FIELDS, query_start_loc, 0, 0, max_query_len, num_threads};
  return paged_cpu::run(paged_cpu::kPrefill, a);
}

// Attention mass (attention_mass.h) into `out`, fp32 [num_seqs, num_kv_heads, max_seq_len] the caller
// zeroed, from each sequence's last `last_queries` rows of `query_start_loc` (0: all of them), logits
// soft-capped when soft_cap > 0.
extern "C" int attention_mass_cpu(PAGED_CPU_COMMON_ARGS, const int32_t *query_start_loc, int last_queries,
                                  int max_seq_len, float soft_cap, int num_threads) {
  const Args a{PAGED_CPU_COMMON_FIELDS, query_start_loc, 0, max_seq_len, 0, num_threads};
  if (a.block_size <= 0) return 1;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads) return 2;
  if (a.dtype != paged_cpu::kF32 && a.dtype != paged_cpu::kF16 && a.dtype != paged_cpu::kBF16) return 7;
  if (num_threads <= 0) return 6;
  float *mass = static_cast<float *>(out);
  const auto run = [&](auto cache) {
    paged_cpu::run_attention_mass<decltype(cache)>(a, mass, last_queries, max_seq_len, soft_cap);
  };
  switch (a.cache_dtype) {
    case paged_cpu::kF32: run(paged_cpu::F32{}); break;
    case paged_cpu::kF16: run(paged_cpu::F16{}); break;
    case paged_cpu::kBF16: run(paged_cpu::BF16{}); break;
    case paged_cpu::kE4M3:
      if (!a.k_scale) return 8;
      run(paged_cpu::E4M3{});
      break;
    case paged_cpu::kE5M2:
      if (!a.k_scale) return 8;
      run(paged_cpu::E5M2{});
      break;
    default: return 8;
  }
  return 0;
}

// Token slot copies (slots.h) in caches of `element_size`-byte elements; 3 when head_size is not a multiple
// of x = 16 / element_size, 7 for another element size.
extern "C" int copy_slots_cpu(int element_size, int num_layers, const int64_t *key_caches,
                              const int64_t *value_caches, const int64_t *slot_mapping, int64_t num_pairs,
                              int num_heads, int head_size, int block_size, int num_threads) {
  if (num_threads <= 0) return 6;
  if (element_size != 1 && element_size != 2 && element_size != 4) return 7;
  if (head_size <= 0 || head_size % (16 / element_size)) return 3;
  const auto run = [&](auto element) {
    paged_cpu::copy_slots<decltype(element)>(num_layers, key_caches, value_caches, slot_mapping, num_pairs,
                                             num_heads, head_size, block_size, num_threads);
  };
  if (element_size == 1) run(uint8_t{});
  else if (element_size == 2) run(uint16_t{});
  else run(uint32_t{});
  return 0;
}

extern "C" int swap_blocks_cpu(int num_caches, const int64_t *src_caches, const int64_t *dst_caches,
                               const int64_t *block_bytes, const int64_t *block_mapping, int64_t num_pairs,
                               int num_threads) {
  if (num_threads <= 0) return 6;
  paged_cpu::swap_blocks(num_caches, src_caches, dst_caches, block_bytes, block_mapping, num_pairs, num_threads);
  return 0;
}

// key / value [num_tokens, num_kv_heads, head_size] of DType `dtype` with element strides key_strides[3] /
// value_strides[3], converted into caches of another float DType `cache_dtype` (cache_convert.h). 7 for a
// code that is not kF32, kF16 or kBF16, 10 if a slot is >= num_slots; negative slots are skipped.
extern "C" int convert_and_cache_cpu(int dtype, int cache_dtype, const void *key, const int64_t *key_strides,
                                     const void *value, const int64_t *value_strides, void *key_cache,
                                     void *value_cache, const int64_t *slot_mapping, int64_t num_tokens,
                                     int64_t num_slots, int num_kv_heads, int head_size, int block_size,
                                     int num_threads) {
  const auto is_float = [](int code) { return code == paged_cpu::kF32 || code == paged_cpu::kF16 ||
                                              code == paged_cpu::kBF16; };
  if (num_threads <= 0) return 6;
  if (!is_float(dtype) || !is_float(cache_dtype)) return 7;
  if (block_size <= 0) return 1;
  const int x = cache_dtype == paged_cpu::kF32 ? 4 : 8;
  if (head_size <= 0 || head_size % x) return 3;
  if (num_tokens < 0 || num_kv_heads <= 0) return 12;
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slot_mapping[t] >= num_slots) return 10;
  paged_cpu::convert_and_cache_any(dtype, cache_dtype, key, key_strides, value, value_strides, key_cache, value_cache,
                                   slot_mapping, num_tokens, num_kv_heads, head_size, block_size, num_threads);
  return 0;
}

// ---- layer ops (layer_ops.h) ---------------------------------------------------------------------
// Rows are `*_stride` elements apart, columns contiguous. The `*_cpu` entry points take fp32 tensors,
// the `*_bf16_cpu` ones bf16 tensors (their 16-bit patterns) for every pointer but positions.
// `exp_lanes` is the vector width (in floats) of torch's fp32 exp, 8 or 16, or 0 where torch uses
// libm's expf; bf16 SiLU needs none (layer_ops.h).

namespace paged_cpu {
namespace layer {

template <typename T>
int rms_norm_entry(T *out, int64_t out_stride, const T *x, int64_t x_stride, const T *weight, int64_t num_rows,
                   int64_t hidden, float eps, int num_threads) {
  if (num_threads <= 0) return 6;
  if (num_rows < 0 || hidden <= 0) return 12;
  rms_norm(out, out_stride, x, x_stride, weight, num_rows, hidden, eps, num_threads);
  return 0;
}

template <typename T>
int add_rms_norm_entry(T *x, int64_t x_stride, T *residual, int64_t residual_stride, const T *weight,
                       int64_t num_rows, int64_t hidden, float eps, int num_threads) {
  if (num_threads <= 0) return 6;
  if (num_rows < 0 || hidden <= 0) return 12;
  add_rms_norm(x, x_stride, residual, residual_stride, weight, num_rows, hidden, eps, num_threads);
  return 0;
}

// positions int64 [num_rows] into cos / sin [num_positions, head_dim]; 11 if one is out of range.
template <typename T>
int rotary_embedding_entry(T *qk, int64_t row_stride, const int64_t *positions, const T *cos, const T *sin,
                           int64_t num_rows, int64_t num_positions, int num_heads, int head_dim, int num_threads) {
  if (num_threads <= 0) return 6;
  if (num_rows < 0 || num_heads <= 0 || head_dim <= 0 || head_dim % 2) return 12;
  for (int64_t t = 0; t < num_rows; ++t)
    if (positions[t] < 0 || positions[t] >= num_positions) return 11;
  rotary_embedding(qk, row_stride, positions, cos, sin, num_rows, num_heads, head_dim, num_threads);
  return 0;
}

}  // namespace layer
}  // namespace paged_cpu

extern "C" int rms_norm_cpu(float *out, int64_t out_stride, const float *x, int64_t x_stride, const float *weight,
                            int64_t num_rows, int64_t hidden, float eps, int num_threads) {
  return paged_cpu::layer::rms_norm_entry(out, out_stride, x, x_stride, weight, num_rows, hidden, eps, num_threads);
}

extern "C" int rms_norm_bf16_cpu(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t x_stride,
                                 const uint16_t *weight, int64_t num_rows, int64_t hidden, float eps,
                                 int num_threads) {
  return paged_cpu::layer::rms_norm_entry(out, out_stride, x, x_stride, weight, num_rows, hidden, eps, num_threads);
}

extern "C" int add_rms_norm_cpu(float *x, int64_t x_stride, float *residual, int64_t residual_stride,
                                const float *weight, int64_t num_rows, int64_t hidden, float eps, int num_threads) {
  return paged_cpu::layer::add_rms_norm_entry(x, x_stride, residual, residual_stride, weight, num_rows, hidden, eps,
                                              num_threads);
}

extern "C" int add_rms_norm_bf16_cpu(uint16_t *x, int64_t x_stride, uint16_t *residual, int64_t residual_stride,
                                     const uint16_t *weight, int64_t num_rows, int64_t hidden, float eps,
                                     int num_threads) {
  return paged_cpu::layer::add_rms_norm_entry(x, x_stride, residual, residual_stride, weight, num_rows, hidden, eps,
                                              num_threads);
}

extern "C" int silu_and_mul_cpu(float *out, int64_t out_stride, const float *x, int64_t x_stride, int64_t num_rows,
                                int64_t inter, int exp_lanes, int num_threads) {
  if (num_threads <= 0) return 6;
  if (num_rows < 0 || inter <= 0) return 12;
  if (exp_lanes != 0 && exp_lanes != 8 && exp_lanes != 16) return 12;
  paged_cpu::layer::silu_and_mul(out, out_stride, x, x_stride, num_rows, inter, exp_lanes, num_threads);
  return 0;
}

extern "C" int silu_and_mul_bf16_cpu(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t x_stride,
                                     int64_t num_rows, int64_t inter, int num_threads) {
  if (num_threads <= 0) return 6;
  if (num_rows < 0 || inter <= 0) return 12;
  paged_cpu::layer::silu_and_mul(out, out_stride, x, x_stride, num_rows, inter, num_threads);
  return 0;
}

// out [num_rows] int64: each row's argmax (argmax.h) over `cols` fp32 logits.
extern "C" int argmax_rows_cpu(int64_t *out, const float *x, int64_t x_stride, int64_t num_rows, int64_t cols,
                               int num_threads) {
  if (num_threads <= 0) return 6;
  if (num_rows < 0 || cols <= 0) return 12;
  paged_cpu::argmax_rows(out, x, x_stride, num_rows, cols, num_threads);
  return 0;
}

extern "C" int rotary_embedding_cpu(float *qk, int64_t row_stride, const int64_t *positions, const float *cos,
                                    const float *sin, int64_t num_rows, int64_t num_positions, int num_heads,
                                    int head_dim, int num_threads) {
  return paged_cpu::layer::rotary_embedding_entry(qk, row_stride, positions, cos, sin, num_rows, num_positions,
                                                  num_heads, head_dim, num_threads);
}

extern "C" int rotary_embedding_bf16_cpu(uint16_t *qk, int64_t row_stride, const int64_t *positions,
                                         const uint16_t *cos, const uint16_t *sin, int64_t num_rows,
                                         int64_t num_positions, int num_heads, int head_dim, int num_threads) {
  return paged_cpu::layer::rotary_embedding_entry(qk, row_stride, positions, cos, sin, num_rows, num_positions,
                                                  num_heads, head_dim, num_threads);
}

// key / value [num_tokens, num_kv_heads, head_size] with element strides key_strides[3] /
// value_strides[3], into caches of the same dtype, element_size 2 or 4 bytes (fp16 / bf16 / fp32).
// 10 if a slot is >= num_slots (num_blocks * block_size); negative slots are skipped.
extern "C" int reshape_and_cache_cpu(int element_size, const void *key, const int64_t *key_strides,
                                     const void *value, const int64_t *value_strides, void *key_cache,
                                     void *value_cache, const int64_t *slot_mapping, int64_t num_tokens,
                                     int64_t num_slots, int num_kv_heads, int head_size, int block_size,
                                     int num_threads) {
  if (num_threads <= 0) return 6;
  if (element_size != 2 && element_size != 4) return 7;
  if (block_size <= 0) return 1;
  if (head_size <= 0 || head_size % (16 / element_size)) return 3;
  if (num_tokens < 0 || num_kv_heads <= 0) return 12;
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slot_mapping[t] >= num_slots) return 10;
  if (element_size == 4) {
    paged_cpu::layer::reshape_and_cache(
        static_cast<const uint32_t *>(key), key_strides, static_cast<const uint32_t *>(value), value_strides,
        static_cast<uint32_t *>(key_cache), static_cast<uint32_t *>(value_cache), slot_mapping, num_tokens,
        num_kv_heads, head_size, block_size, num_threads);
  } else {
    paged_cpu::layer::reshape_and_cache(
        static_cast<const uint16_t *>(key), key_strides, static_cast<const uint16_t *>(value), value_strides,
        static_cast<uint16_t *>(key_cache), static_cast<uint16_t *>(value_cache), slot_mapping, num_tokens,
        num_kv_heads, head_size, block_size, num_threads);
  }
  return 0;
}

// The packed linear (gemm_packed.h), `kind` 0 for fp32, 1 for bf16: whether this build has it (16
// outputs a register, or 0), the weight's packing, and the layer.
namespace {
template <class F>
int with_gemm_kind(int kind, F &&run) {
#if defined(__AVX512F__)
  if (kind == 0) return run(paged_cpu::gemm::F32{});
#endif
#if defined(__AVX512BF16__)
  if (kind == 1) return run(paged_cpu::gemm::Bf16{});
#endif
  return 7;  // a kind this build lacks, or none
}

// whole blocks of 16 outputs, whole steps of T::K inputs
template <class T>
bool gemm_shape_ok(int64_t out_features, int64_t in_features) {
  return out_features > 0 && in_features > 0 && out_features % paged_cpu::gemm::OUT_MULTIPLE == 0 &&
         in_features % T::K == 0;
}
}  // namespace

extern "C" int gemm_packed_lanes_cpu(int kind) {
  return with_gemm_kind(kind, [](auto) { return 0; }) == 0 ? paged_cpu::gemm::LANES : 0;
}

extern "C" int gemm_pack_cpu(int kind, const void *weight, int64_t out_features, int64_t in_features, void *packed) {
  return with_gemm_kind(kind, [&](auto type) {
#if defined(__AVX512F__)
    using T = decltype(type);
    if (!gemm_shape_ok<T>(out_features, in_features)) return 15;
    paged_cpu::gemm::pack<T>(static_cast<const typename T::Elem *>(weight), out_features, in_features,
                             static_cast<typename T::Elem *>(packed));
#endif
    return 0;
  });
}

extern "C" int gemm_packed_cpu(int kind, void *y, int64_t y_stride, const void *x, int64_t x_stride,
                               const void *packed, int64_t num_rows, int64_t out_features, int64_t in_features,
                               int num_threads) {
  if (num_threads <= 0) return 6;
  return with_gemm_kind(kind, [&](auto type) {
#if defined(__AVX512F__)
    using T = decltype(type);
    if (num_rows < 0 || !gemm_shape_ok<T>(out_features, in_features)) return 15;
    paged_cpu::gemm::linear<T>(static_cast<typename T::Elem *>(y), y_stride, static_cast<const typename T::Elem *>(x),
                               x_stride, static_cast<const typename T::Elem *>(packed), num_rows, out_features,
                               in_features, num_threads);
#endif
    return 0;
  });
}

// ---- a Llama decoder's layers in one call (paged/model/decode_layers.py) ------------------------
// A decode step's forward from the first layer's norm to the final norm, kind 0 fp32 / 1 bf16: the
// calls the Python forward (paged/model/llama.py) makes, in its order, with its arguments and thread
// count, so its hidden states are that forward's to the bit; only the Python between them is gone
// (~20% of a bf16 decode forward of 32 rows on a 2-core EPYC, with the second thread falling asleep
// in each gap and woken by the next call). Per layer l:
//   qkv = x @ qkv[l]; q, k rotated in place; k, v into the caches at slot_mapping;
//   attn_out = v3 decode attention (one query row per sequence, no feature); x = attn_out @ o[l];
//   residual += x, x = rms_norm(residual) * mlp_norms[l]; gate_up = x @ gate_up[l];
//   act = silu(gate) * up; x = act @ down[l]; residual += x, x = rms_norm(residual) * next_norms[l]
// (next_norms: the next layer's input norm, the final norm for the last). x holds the first layer's
// normed input on entry, the final normed hidden states on return. The weight, norm and cache
// arguments are arrays of num_layers addresses. Returns 0, or (layer * 16 + call) * 256 + the refusing
// call's status, call 1-10 in the order above (qkv, rope, cache write, attention, o, mlp norm,
// gate_up, silu, down, next norm).
namespace {

inline void *address(int64_t value) { return reinterpret_cast<void *>(static_cast<intptr_t>(value)); }

}  // namespace

extern "C" int decode_layers_cpu(int kind, int num_layers, int64_t num_rows, int64_t hidden, int num_heads,
                                 int num_kv_heads, int head_dim, int64_t inter, void *x, void *residual, void *qkv,
                                 void *attn_out, void *gate_up, void *act, const int64_t *qkv_weights,
                                 const int64_t *o_weights, const int64_t *gate_up_weights,
                                 const int64_t *down_weights, const int64_t *mlp_norms, const int64_t *next_norms,
                                 const int64_t *key_caches, const int64_t *value_caches, float eps,
                                 const int64_t *positions, const void *cos, const void *sin, int64_t num_positions,
                                 const int64_t *slot_mapping, int64_t num_slots, int block_size,
                                 const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, float scale,
                                 int num_splits, int split_blocks, int max_seq_len, int exp_lanes, int num_threads) {
  if (kind != 0 && kind != 1) return 7;
  if (num_layers < 0 || num_rows < 0 || hidden <= 0 || inter <= 0 || num_heads <= 0 || num_kv_heads <= 0 ||
      head_dim <= 0)
    return 12;
  const bool f32 = kind == 0;
  const int dtype = f32 ? paged_cpu::kF32 : paged_cpu::kBF16;
  const int element = f32 ? 4 : 2;
  const int64_t q_width = int64_t{num_heads} * head_dim, kv_width = int64_t{num_kv_heads} * head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width;
  const int64_t kv_strides[3] = {qkv_width, head_dim, 1};
  const char *key = static_cast<const char *>(qkv) + q_width * element;
  const char *value = key + kv_width * element;
  const auto norm = [&](const int64_t weight) {
    return f32 ? add_rms_norm_cpu(static_cast<float *>(x), hidden, static_cast<float *>(residual), hidden,
                                  static_cast<const float *>(address(weight)), num_rows, hidden, eps, num_threads)
               : add_rms_norm_bf16_cpu(static_cast<uint16_t *>(x), hidden, static_cast<uint16_t *>(residual), hidden,
                                       static_cast<const uint16_t *>(address(weight)), num_rows, hidden, eps,
                                       num_threads);
  };
  for (int l = 0; l < num_layers; ++l) {
    int call = 0, status = 0;
    const auto step = [&](int s) {
      ++call;
      status = s;
      return s == 0;
    };
    const bool ok =
        step(gemm_packed_cpu(kind, qkv, qkv_width, x, hidden, address(qkv_weights[l]), num_rows, qkv_width, hidden,
                             num_threads)) &&
        step(f32 ? rotary_embedding_cpu(static_cast<float *>(qkv), qkv_width, positions, static_cast<const float *>(cos),
                                        static_cast<const float *>(sin), num_rows, num_positions,
                                        num_heads + num_kv_heads, head_dim, num_threads)
                 : rotary_embedding_bf16_cpu(static_cast<uint16_t *>(qkv), qkv_width, positions,
                                             static_cast<const uint16_t *>(cos), static_cast<const uint16_t *>(sin),
                                             num_rows, num_positions, num_heads + num_kv_heads, head_dim,
                                             num_threads)) &&
        step(reshape_and_cache_cpu(element, key, kv_strides, value, kv_strides, address(key_caches[l]),
                                   address(value_caches[l]), slot_mapping, num_rows, num_slots, num_kv_heads, head_dim,
                                   block_size, num_threads)) &&
        step(paged_attention_v3_cpu(dtype, dtype, attn_out, qkv, qkv_width, head_dim, 1, address(key_caches[l]),
                                    address(value_caches[l]), block_tables, bt_stride, seq_lens,
                                    static_cast<int>(num_rows), num_heads, num_kv_heads, head_dim, block_size, scale, 0,
                                    nullptr, nullptr, nullptr, 0, 0, 0, 0, num_splits, split_blocks, max_seq_len,
                                    num_threads)) &&
        step(gemm_packed_cpu(kind, x, hidden, attn_out, q_width, address(o_weights[l]), num_rows, hidden, q_width,
                             num_threads)) &&
        step(norm(mlp_norms[l])) &&
        step(gemm_packed_cpu(kind, gate_up, 2 * inter, x, hidden, address(gate_up_weights[l]), num_rows, 2 * inter,
                             hidden, num_threads)) &&
        step(f32 ? silu_and_mul_cpu(static_cast<float *>(act), inter, static_cast<const float *>(gate_up), 2 * inter,
                                    num_rows, inter, exp_lanes, num_threads)
                 : silu_and_mul_bf16_cpu(static_cast<uint16_t *>(act), inter, static_cast<const uint16_t *>(gate_up),
                                         2 * inter, num_rows, inter, num_threads)) &&
        step(gemm_packed_cpu(kind, x, hidden, act, inter, address(down_weights[l]), num_rows, hidden, inter,
                             num_threads)) &&
        step(norm(next_norms[l]));
    if (!ok) return (l * 16 + call) * 256 + status;
  }
  return 0;
}
