// Paged varlen prefill attention: causal attention of a batch of sequences' new queries to their
// whole context, read through the block tables straight from the paged cache (no gather, no copy).
//
// Sequence s owns query rows query_start_loc[s] .. query_start_loc[s + 1], the last q_len of its
// seq_lens[s] positions (q_len < seq_len after a prefix-cache hit or for a prefill chunk; q_len = 1
// is a decode row). The query at position p sees keys p - W < k <= p with a sliding window W
// (0: none), ALiBi adds slope * (k - p), a block-sparse pattern drops the blocks its head does not
// see from p's sparse block (attention.cuh's rule), and an fp8 cache is read as float(fp8) * scale
// of the KV head.
//
// Grid (row tiles, num_kv_heads, num_seqs). A CTA owns PrefillTiles::ROWS rows of one sequence and
// one KV head, row r being query r / G of head r % G (G query heads per KV head), so each K/V tile
// it loads serves the whole group (the GQA reuse flash-decoding kernels get from packing heads).
// Its four warps own M m16 tiles of rows each: two for fp16 / bf16 at head sizes up to 128 (each
// K and V fragment read from shared memory then feeds two tensor-core products, which halves the
// shared-memory bytes per product, flash-attention 2's 128-row CTAs), else one. Per tile of KEYS
// keys, flash-attention 2's loop: S = Q·Kᵀ, the online softmax (running max and sum per row),
// O += P·V. The K/V tiles go through shared memory in the cache's own element type (K row-major,
// V transposed so each head dim's keys are contiguous, rows padded by 16 bytes against bank
// conflicts), copied with cp.async one tile ahead of the computation (STAGES buffers). fp16 and
// bf16 run both products on tensor cores (mma.cuh; P goes from the S accumulators into the A
// fragments without leaving registers, rounded to T as flash-attention does), an fp8 tile
// converted in registers on the way to them (mma.cuh's fragment_pair: raw halves, exact in fp16
// and bf16, the KV scales carrying fp8_vec.cuh's factor), so an fp8 cache moves half the bytes
// into shared memory; fp32, and targets before sm_80, compute the same fragments on CUDA cores,
// P passed between the lanes by shuffles. Accumulation is fp32 throughout.
//
// The causal shape: a CTA stops at the tile holding its last query's key, a warp whose rows all
// precede a tile skips it, a tile every row sees whole is not masked, and the CTAs with the most
// keys (the last row tiles) are launched first so they do not trail the grid.
//
// Keys a tile does not need read as zeros and are never loaded: before the tile's first query's
// window (those blocks may have been freed and reused), past its last query (unwritten slots may
// hold NaN), and, under block-sparse attention, in sparse blocks no row of the tile sees. Masked
// logits are -inf, whatever the slot held. The k_scale is folded into the softmax scale and the
// v_scale into the final normalisation.
#pragma once

#include "async_copy.cuh"
#include "attention.cuh"
#include "mma.cuh"

namespace paged {

constexpr int PREFILL_WARPS = 4;
constexpr int PREFILL_THREADS = PREFILL_WARPS * WARP_SIZE;

// A CTA's tiling and shared memory (paged/kernels/backends/launch.py computes the same bytes): the
// Q tile in T, then per stage a K and a Vᵀ tile in the cache's element type C.
template <typename T, typename C, int HEAD_SIZE>
struct PrefillTiles {
  static constexpr bool WIDE = sizeof(T) == 2 && HEAD_SIZE <= 128;  // fp32 and head 256 hold no more
  static constexpr int M = WIDE ? 2 : 1;                            // m16 row tiles per warp
  static constexpr int ROWS = 16 * M * PREFILL_WARPS;              // query rows of a CTA
  // Keys per K/V tile: 64 where the registers allow (S and O fragments of two row tiles at head 64).
  static constexpr int KEYS = WIDE && HEAD_SIZE <= 64 ? 64 : 32;
  // Rows padded by 16 bytes, against bank conflicts.
  static constexpr int QROW = HEAD_SIZE + 16 / static_cast<int>(sizeof(T));  // Q rows, in T
  static constexpr int KROW = HEAD_SIZE + 16 / static_cast<int>(sizeof(C));  // K rows, in C
  static constexpr int VROW = KEYS + 16 / static_cast<int>(sizeof(C));       // Vᵀ rows, in C
  static constexpr int Q_BYTES = ROWS * QROW * static_cast<int>(sizeof(T));
  static constexpr int STAGE_BYTES = (KEYS * KROW + HEAD_SIZE * VROW) * static_cast<int>(sizeof(C));
  // Two K/V buffers (one tile loads while the other is computed) where they fit in 96 KB, the
  // opt-in limit of sm_86 / sm_89 (99 KB), else one: head 256 in 16 bits, fp32 from head 128.
  static constexpr int STAGES = Q_BYTES + 2 * STAGE_BYTES <= 96 * 1024 ? 2 : 1;
  static constexpr int BYTES = Q_BYTES + STAGES * STAGE_BYTES;
};

// An element of zero bits: +0 in every format the cache holds.
template <typename C>
PAGED_DEVICE C zero_bits() {
  C x;
  unsigned char* bytes = reinterpret_cast<unsigned char*>(&x);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(C)); ++i) bytes[i] = 0;
  return x;
}

// Which keys a CTA reads: positions [begin, end), and under block-sparse attention those whose
// sparse block some row of the tile sees (any head of the group, from the earliest query's block:
// a superset of what each row keeps, which the logits' mask then narrows).
struct TileKeys {
  int begin, end;
  bool sparse;
  int first_q_block, first_head, group;
  const Features* f;

  PAGED_DEVICE bool needed(int key) const {
    if (key < begin || key >= end) return false;
    if (!sparse) return true;
    const int k_block = key / f->bs_block_size;
    if (k_block > first_q_block - f->bs_local_blocks) return true;
    for (int h = 0; h < group; ++h) {
      const int head = first_head + h;
      const int offset = f->bs_head_sliding_step >= 0 ? head * f->bs_head_sliding_step + 1
                                                      : (first_head / group) * -f->bs_head_sliding_step + 1;
      if ((k_block + offset) % f->bs_vert_stride == 0) return true;
    }
    return false;
  }
};

// Grid (div_up(max_query_len * G, PrefillTiles::ROWS), num_kv_heads, num_seqs); PREFILL_THREADS
// threads; PrefillTiles::BYTES of dynamic shared memory: the Q tile [ROWS][QROW] in T, then STAGES
// times a K tile [KEYS][KROW] and a Vᵀ tile [HEAD_SIZE][VROW] in CACHE_T. `out` is [num_tokens,
// num_heads, HEAD_SIZE]; query rows are `q_stride` elements apart.
template <typename T, typename CACHE_T, int HEAD_SIZE, int BLOCK_SIZE, bool FEATURES>
__global__ void prefill_attention_kernel(T* __restrict__ out, const T* __restrict__ q,
                                         const CACHE_T* __restrict__ k_cache, const CACHE_T* __restrict__ v_cache,
                                         int num_heads, int num_kv_heads, float scale,
                                         const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                                         const int* __restrict__ query_start_loc, int max_num_blocks_per_seq,
                                         int q_stride, int kv_block_stride, int kv_head_stride, int sliding_window,
                                         FEATURE_PARAMS) {
  typedef PrefillTiles<T, CACHE_T, HEAD_SIZE> L;
  constexpr bool FP8 = sizeof(CACHE_T) == 1;
  constexpr bool MMA = PAGED_HAS_MMA && sizeof(T) == 2;
  constexpr int M = L::M, R = 2 * M, KEYS = L::KEYS, QROW = L::QROW, KROW = L::KROW, VROW = L::VROW;
  constexpr int X = 16 / sizeof(CACHE_T);             // K cache elements per 16-byte chunk
  constexpr int QV = 16 / sizeof(T);                  // query elements per 16-byte vector
  // V cache keys per copy: 16 bytes, or a whole 8-token block of fp8 (8 bytes).
  constexpr int VV = cmin(16 / static_cast<int>(sizeof(CACHE_T)), BLOCK_SIZE);
  constexpr int NT = KEYS / 8;                        // 8-key column tiles of S
  constexpr int DT = HEAD_SIZE / 8;                   // 8-dim column tiles of O
  static_assert(HEAD_SIZE % 16 == 0, "tensor-core k-steps of 16 head dims");
  static_assert(BLOCK_SIZE % VV == 0 && KEYS % VV == 0, "a V vector never straddles a cache block");
  const float neg_inf = negative_infinity();

  const int group = num_heads / num_kv_heads;
  const int kv_head = blockIdx.y, seq = blockIdx.z;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int num_rows = q_len * group;
  // Causal: later row tiles attend to more keys, so they are launched first.
  const int row0 = (gridDim.x - 1 - blockIdx.x) * L::ROWS;
  if (row0 >= num_rows) return;
  const int seq_len = seq_lens[seq];
  const int context = seq_len - q_len;  // position of the sequence's first query
  const int last_row = cmin(row0 + L::ROWS, num_rows) - 1;
  const int first_pos = context + row0 / group, last_pos = context + last_row / group;
  const int* block_table = block_tables + static_cast<int64>(seq) * max_num_blocks_per_seq;
  const Features f = FEATURE_ARGS;
  const bool sparse = FEATURES && f.bs_vert_stride > 0;
  const TileKeys keys{window_start(first_pos + 1, sliding_window), last_pos + 1, sparse,
                      sparse ? first_pos / f.bs_block_size : 0, kv_head * group, group, &f};
  // Keys from here to first_pos are visible to every row of the CTA (the last row's window start).
  const int open_begin = window_start(last_pos + 1, sliding_window);
  // The tensor cores take fp8 as raw halves (fp8_vec.cuh): the KV scales carry their factor.
  const float raw = MMA ? raw_scale<CACHE_T>() : 1.f;
  const float qk_scale = scale * (FP8 ? k_scales[kv_head] * raw : 1.f);
  const float v_scale = FP8 ? v_scales[kv_head] * raw : 1.f;
  const CACHE_T* k_head = k_cache + static_cast<int64>(kv_head) * kv_head_stride;
  const CACHE_T* v_head = v_cache + static_cast<int64>(kv_head) * kv_head_stride;

  T* q_s = reinterpret_cast<T*>(dynamic_smem());
  char* stages = dynamic_smem() + L::Q_BYTES;

  for (int i = threadIdx.x; i < L::ROWS * (HEAD_SIZE / QV); i += PREFILL_THREADS) {
    const int r = i / (HEAD_SIZE / QV), c = i % (HEAD_SIZE / QV) * QV;
    const int row = row0 + r;
    Vec<T, QV> v;
    if (row < num_rows) {
      const int head = kv_head * group + row % group;
      v = load_vec<T, QV>(q + static_cast<int64>(q_start + row / group) * q_stride + head * HEAD_SIZE + c);
    } else {
#pragma unroll
      for (int e = 0; e < QV; ++e) v.val[e] = from_float<T>(0.f);
    }
    *reinterpret_cast<Vec<T, QV>*>(q_s + r * QROW + c) = v;
  }

  const int tile0 = keys.begin / KEYS * KEYS;
  const int num_tiles = div_up(keys.end - tile0, KEYS);

  // Starts tile j's K and V on their way into stage j % STAGES with cp.async (unneeded keys as
  // zeros, stored at once) and closes a commit group, so every thread counts the same groups.
  auto issue = [&](int j) {
    if (j < num_tiles) {
      const int n0 = tile0 + j * KEYS;
      CACHE_T* k_s = reinterpret_cast<CACHE_T*>(stages + (j % L::STAGES) * L::STAGE_BYTES);
      CACHE_T* v_s = k_s + KEYS * KROW;
      for (int i = threadIdx.x; i < KEYS * (HEAD_SIZE / X); i += PREFILL_THREADS) {
        const int key = i / (HEAD_SIZE / X), chunk = i % (HEAD_SIZE / X);
        const int position = n0 + key;
        CACHE_T* dst = k_s + key * KROW + chunk * X;
        if (keys.needed(position)) {
          cp_async16(dst, k_head + static_cast<int64>(block_table[position / BLOCK_SIZE]) * kv_block_stride +
                              (chunk * BLOCK_SIZE + position % BLOCK_SIZE) * X);
        } else {
          *reinterpret_cast<uint4*>(dst) = uint4{};
        }
      }
      for (int i = threadIdx.x; i < HEAD_SIZE * (KEYS / VV); i += PREFILL_THREADS) {
        const int dim = i / (KEYS / VV), first = i % (KEYS / VV) * VV;
        const int position = n0 + first;
        CACHE_T* dst = v_s + dim * VROW + first;
        // A copy lies in one cache block and one sparse block (a multiple of the cache block).
        if (keys.needed(position) && keys.needed(position + VV - 1)) {
          const CACHE_T* src = v_head + static_cast<int64>(block_table[position / BLOCK_SIZE]) * kv_block_stride +
                               dim * BLOCK_SIZE + position % BLOCK_SIZE;
          if constexpr (VV * sizeof(CACHE_T) == 16) {
            cp_async16(dst, src);
          } else {
            cp_async8(dst, src);
          }
        } else {
          for (int e = 0; e < VV; ++e) {
            const int p = position + e;
            dst[e] = keys.needed(p) ? v_head[block_table[p / BLOCK_SIZE] * static_cast<int64>(kv_block_stride) +
                                             dim * BLOCK_SIZE + p % BLOCK_SIZE]
                                    : zero_bits<CACHE_T>();
          }
        }
      }
    }
    cp_async_commit();
  };

  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int g = lane / 4, t = lane % 4;
  const int warp_row0 = row0 + warp * 16 * M;
  // The warp's last live row's position; a warp of padding rows only never computes.
  const int warp_last_pos = warp_row0 < num_rows ? context + (cmin(warp_row0 + 16 * M, num_rows) - 1) / group : -1;
  // This lane's rows g and g + 8 of each of the warp's m16 tiles (row r: tile r / 2, half r % 2):
  // position, head and what they attend to.
  int pos[R], first_key[R], sparse_offset[R], q_block[R];
  bool live[R];
  float slope[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = warp_row0 + (r / 2) * 16 + g + 8 * (r % 2);
    live[r] = row < num_rows;
    const int rr = live[r] ? row : last_row;  // a padding row attends like a live one and is not written
    const int head = kv_head * group + rr % group;
    pos[r] = context + rr / group;
    first_key[r] = window_start(pos[r] + 1, sliding_window);
    slope[r] = FEATURES && f.alibi_slopes ? f.alibi_slopes[head] : 0.f;
    sparse_offset[r] = f.bs_head_sliding_step >= 0 ? head * f.bs_head_sliding_step + 1
                                                   : kv_head * -f.bs_head_sliding_step + 1;
    q_block[r] = sparse ? pos[r] / f.bs_block_size : 0;
  }

  float o[M][DT][4];
#pragma unroll
  for (int mt = 0; mt < M; ++mt) {
#pragma unroll
    for (int d = 0; d < DT; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
  }
  float m[R], l[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = neg_inf;
    l[r] = 0.f;
  }
  const T* q_w = q_s + (warp * 16 * M) * QROW;

  // One warp's rows against tile j.
  auto compute = [&](int j) {
    const int n0 = tile0 + j * KEYS;
    if (n0 > warp_last_pos) return;  // every row of the warp precedes the tile (the whole warp returns)
    const CACHE_T* k_s = reinterpret_cast<const CACHE_T*>(stages + (j % L::STAGES) * L::STAGE_BYTES);
    const CACHE_T* v_s = k_s + KEYS * KROW;

    float s[M][NT][4];
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
#pragma unroll
      for (int n = 0; n < NT; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
    }
    if constexpr (MMA) {
      // Each K fragment serves the warp's M row tiles.
#pragma unroll
      for (int kk = 0; kk < HEAD_SIZE; kk += 16) {
        unsigned a[M][4];
#pragma unroll
        for (int mt = 0; mt < M; ++mt) {
          const T* q_m = q_w + mt * 16 * QROW + kk + 2 * t;
          a[mt][0] = load2(q_m + g * QROW);
          a[mt][1] = load2(q_m + (g + 8) * QROW);
          a[mt][2] = load2(q_m + g * QROW + 8);
          a[mt][3] = load2(q_m + (g + 8) * QROW + 8);
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const CACHE_T* k_row = k_s + (n * 8 + g) * KROW + kk;
          const unsigned b[2] = {fragment_pair<T>(k_row + 2 * t), fragment_pair<T>(k_row + 8 + 2 * t)};
#pragma unroll
          for (int mt = 0; mt < M; ++mt) mma_16816<T>(s[mt][n], a[mt], b);
        }
      }
    } else {
      // The same fragments on CUDA cores: each Q and K element read once per lane and tile.
#pragma unroll 4
      for (int d = 0; d < HEAD_SIZE; ++d) {
        float k0[NT], k1[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          k0[n] = to_float(k_s[(n * 8 + 2 * t) * KROW + d]);
          k1[n] = to_float(k_s[(n * 8 + 2 * t + 1) * KROW + d]);
        }
#pragma unroll
        for (int mt = 0; mt < M; ++mt) {
          const float q0 = to_float(q_w[(mt * 16 + g) * QROW + d]);
          const float q1 = to_float(q_w[(mt * 16 + g + 8) * QROW + d]);
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            s[mt][n][0] += q0 * k0[n];
            s[mt][n][1] += q0 * k1[n];
            s[mt][n][2] += q1 * k0[n];
            s[mt][n][3] += q1 * k1[n];
          }
        }
      }
    }

    // Scale, bias and mask (not needed when every row sees the whole tile); each row's tile
    // maximum over its four lanes.
    const bool open = !sparse && n0 >= open_begin && n0 + KEYS - 1 <= first_pos;
    float tile_max[R];
#pragma unroll
    for (int r = 0; r < R; ++r) tile_max[r] = neg_inf;
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int r = 2 * mt + c / 2, key = n0 + n * 8 + 2 * t + c % 2;
          float logit = s[mt][n][c] * qk_scale;
          if (FEATURES) logit += slope[r] * static_cast<float>(key - pos[r]);
          if (!open) {
            bool keep = key <= pos[r] && key >= first_key[r];
            if (sparse) keep = keep && sparse_keeps(f, key, q_block[r], sparse_offset[r]);
            logit = keep ? logit : neg_inf;
          }
          s[mt][n][c] = logit;
          tile_max[r] = fmaxf(tile_max[r], logit);
        }
      }
    }
    float base[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(FULL_MASK, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(FULL_MASK, tile_max[r], 2));
      const float m_new = fmaxf(m[r], tile_max[r]);
      // A row with nothing visible yet keeps exp(-inf - 0) = 0 everywhere instead of NaN.
      base[r] = m_new == neg_inf ? 0.f : m_new;
      const float alpha = __expf(m[r] - base[r]);
      m[r] = m_new;
      l[r] *= alpha;
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        o[r / 2][d][2 * (r % 2)] *= alpha;
        o[r / 2][d][2 * (r % 2) + 1] *= alpha;
      }
    }
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          s[mt][n][c] = __expf(s[mt][n][c] - base[2 * mt + c / 2]);
          l[2 * mt + c / 2] += s[mt][n][c];
        }
      }
    }

    if constexpr (MMA) {
      // Each V fragment serves the warp's M row tiles.
#pragma unroll
      for (int kk = 0; kk < KEYS / 16; ++kk) {
        unsigned a[M][4];
#pragma unroll
        for (int mt = 0; mt < M; ++mt) {
          a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int d = 0; d < DT; ++d) {
          const CACHE_T* v_row = v_s + (d * 8 + g) * VROW + kk * 16;
          const unsigned b[2] = {fragment_pair<T>(v_row + 2 * t), fragment_pair<T>(v_row + 8 + 2 * t)};
#pragma unroll
          for (int mt = 0; mt < M; ++mt) mma_16816<T>(o[mt][d], a[mt], b);
        }
      }
    } else {
      // Key k's probabilities of rows g and g + 8 live in lane (g, (k % 8) / 2) of the quad: fetched
      // eight keys (one S column tile) at a time.
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        float p[M][8][2];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int src = (lane & ~3) | (e / 2);
#pragma unroll
          for (int mt = 0; mt < M; ++mt) {
            p[mt][e][0] = __shfl_sync(FULL_MASK, s[mt][n][e % 2], src);
            p[mt][e][1] = __shfl_sync(FULL_MASK, s[mt][n][2 + e % 2], src);
          }
        }
#pragma unroll
        for (int d = 0; d < DT; ++d) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int k = n * 8 + e;
            const float v0 = to_float(v_s[(d * 8 + 2 * t) * VROW + k]);
            const float v1 = to_float(v_s[(d * 8 + 2 * t + 1) * VROW + k]);
#pragma unroll
            for (int mt = 0; mt < M; ++mt) {
              o[mt][d][0] += p[mt][e][0] * v0;
              o[mt][d][1] += p[mt][e][0] * v1;
              o[mt][d][2] += p[mt][e][1] * v0;
              o[mt][d][3] += p[mt][e][1] * v1;
            }
          }
        }
      }
    }
  };

  // The K/V pipeline: tile j + STAGES - 1 is in flight while tile j is computed.
  if constexpr (L::STAGES == 1) {
    for (int j = 0; j < num_tiles; ++j) {
      __syncthreads();  // the previous tile is consumed (and, the first time, the Q tile complete)
      issue(j);
      cp_async_wait<0>();
      __syncthreads();
      compute(j);
    }
  } else {
    for (int j = 0; j < L::STAGES - 1; ++j) issue(j);
    for (int j = 0; j < num_tiles; ++j) {
      cp_async_wait<L::STAGES - 2>();
      // Tile j (and, the first time, the Q tile) is in every thread's view; tile j - 1's stage is free.
      __syncthreads();
      issue(j + L::STAGES - 1);
      compute(j);
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
    l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
    if (!live[r]) continue;
    const int row = warp_row0 + (r / 2) * 16 + g + 8 * (r % 2);
    const float inv = v_scale / l[r];  // the row's own key is always visible, so l >= exp(0) = 1
    T* out_row = out + (static_cast<int64>(q_start + row / group) * num_heads + kv_head * group + row % group) *
                           HEAD_SIZE;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      out_row[d * 8 + 2 * t] = from_float<T>(o[r / 2][d][2 * (r % 2)] * inv);
      out_row[d * 8 + 2 * t + 1] = from_float<T>(o[r / 2][d][2 * (r % 2) + 1] * inv);
    }
  }
}

}  // namespace paged
