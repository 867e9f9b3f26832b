// A linear layer on AVX-512 with its weight packed once: fp32 (FMAs) and bf16 (AVX512-BF16's
// vdpbf16ps); paged/kernels/packed_linear.py says when each runs.
//
// y[m][o] = sum_k x[m][k] * w[o][k] with fp32 sums, each in the order of k (bf16: a pair of k per
// instruction, denormals flushed, one rounding to bf16 at the end, as a bf16 GEMM does). With a
// few rows (a decode step's) a layer is bound by streaming its weight, and the cost that matters is
// the rest: at one row on a 2-core AVX512 EPYC oneDNN's small-M matmul streamed ~11 GB/s of bf16
// weights and ~19 GB/s of fp32 ones, this loop ~19 GB/s of bf16 on one core and ~38 GB/s of fp32 on
// two. With many rows (prefill) the tiles of 6 rows x 64 outputs keep 24 sums in registers (of 32)
// and run at oneDNN's speed.
//
// The weight is packed once as [out/16][in/K][16][K] (K = inputs an instruction takes per output:
// 1 for fp32, 2 for bf16): for each block of 16 outputs, K consecutive inputs of every output side
// by side, so one 64-byte load feeds 16 outputs, and each block is read once per TILE_ROWS rows.
//
// A panel (the BLOCKS blocks a tile keeps in registers: 72 KB of bf16 at 576 inputs) comes from
// memory for its first tile of rows and from L2 for the others, so with a decode's 7-32 rows the
// memory sat idle while a thread computed from L2, then the thread waited on memory: the layers ran
// at 16.7 ms a step with SmolLM2's weights in L3 against 20.8 from memory at 32 rows (bf16, 2
// threads). So the tiles ask for the next panel's lines as they go (prefetcht1, spread over the
// panel's tiles): SmolLM2's 120 layer calls of a step 9-12% faster at 12-16 rows, 2-5% at 32-48,
// level at 1-8, 6-7% over a draining batch's rows 32 down to 1, bf16 and fp32 alike (docs/speed.md).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace paged_cpu {
namespace gemm {

constexpr int LANES = 16;      // outputs per register
constexpr int BLOCKS = 4;      // output blocks a tile keeps in registers
constexpr int TILE_ROWS = 6;   // rows a tile keeps in registers: 6 x 4 sums + 4 weights + 1 input of 32
// Rows a thread takes through all its blocks before the next rows: a prefill's thousands of rows
// would otherwise come from memory once per tile of outputs (2,900 rows: 10-13% behind oneDNN; with
// 48-384 alike, level but for gate_up's 3072 outputs, 5% behind).
constexpr int64_t ROW_BLOCK = 96;
constexpr int OUT_MULTIPLE = LANES;  // whole blocks; a layer's last tile may hold 1-3 of them
// The most row tiles a panel may have and still ask for the next panel as it goes (below): 8 tiles,
// 43-48 rows; at 64 rows and more the next panel's wait is a small part of a panel's time, and the
// requests cost 1-3% (at 96-512 rows, a prefill's).
constexpr int64_t PREFETCH_TILES = 8;

#if defined(__AVX512F__)
// Without AVX-512 (an AVX2 build) nothing below exists and the entry points report the kind missing.
// fp32: one input per output and instruction, an FMA.
struct F32 {
  using Elem = float;
  using Weights = __m512;
  static constexpr int K = 1;
  static Weights load(const Elem *w) { return _mm512_loadu_ps(w); }
  static Weights broadcast(const Elem *x) { return _mm512_set1_ps(*x); }
  static __m512 madd(__m512 acc, Weights w, Weights x) { return _mm512_fmadd_ps(w, x, acc); }
  static void store(Elem *y, __m512 acc) { _mm512_storeu_ps(y, acc); }
};

#if defined(__AVX512BF16__)
// bf16: a pair of inputs per output and instruction (vdpbf16ps), the sums rounded once to bf16.
struct Bf16 {
  using Elem = uint16_t;
  using Weights = __m512bh;
  static constexpr int K = 2;
  static Weights load(const Elem *w) { return (__m512bh)_mm512_loadu_si512(w); }
  static Weights broadcast(const Elem *x) {
    uint32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
  }
  static __m512 madd(__m512 acc, Weights w, Weights x) { return _mm512_dpbf16_ps(acc, w, x); }
  static void store(Elem *y, __m512 acc) {
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(y), (__m256i)_mm512_cvtneps_pbh(acc));
  }
};
#endif  // __AVX512BF16__

template <class T>
inline void pack(const typename T::Elem *w, int64_t out_features, int64_t in_features, typename T::Elem *packed) {
  const int64_t steps = in_features / T::K;
  for (int64_t block = 0; block < out_features / LANES; ++block)
    for (int64_t s = 0; s < steps; ++s)
      for (int lane = 0; lane < LANES; ++lane)
        std::memcpy(packed + ((block * steps + s) * LANES + lane) * T::K,
                    w + (block * LANES + lane) * in_features + s * T::K, T::K * sizeof(typename T::Elem));
}

// The next panel's lines a tile asks for as it computes: `lines` 64-byte lines from `next`, spread
// evenly over its steps (a prefetch between every few instructions, not a burst that stalls them).
struct Prefetch {
  const char *next = nullptr;
  int64_t lines = 0;
};

// MR rows of x against NB blocks of 16 outputs starting at `block`.
template <class T, int MR, int NB>
inline void tile(typename T::Elem *y, int64_t y_stride, const typename T::Elem *x, int64_t x_stride,
                 const typename T::Elem *packed, int64_t steps, int64_t block, Prefetch pf = {}) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  const int64_t block_elems = steps * LANES * T::K;
  const typename T::Elem *w = packed + block * block_elems;
  int64_t due = 0;
  for (int64_t s = 0; s < steps; ++s) {
    for (due += pf.lines; due >= steps; due -= steps, pf.next += 64) _mm_prefetch(pf.next, _MM_HINT_T1);
    typename T::Weights wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = T::load(w + b * block_elems + s * LANES * T::K);
    for (int m = 0; m < MR; ++m) {
      const typename T::Weights xv = T::broadcast(x + m * x_stride + s * T::K);
      for (int b = 0; b < NB; ++b) acc[m][b] = T::madd(acc[m][b], wv[b], xv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) T::store(y + m * y_stride + (block + b) * LANES, acc[m][b]);
}

// Every row against NB blocks from `block`: their weights come from memory once and from the cache
// for each further TILE_ROWS rows.
template <class T, int NB>
inline void blocks_rows(typename T::Elem *y, int64_t y_stride, const typename T::Elem *x, int64_t x_stride,
                        const typename T::Elem *packed, int64_t num_rows, int64_t steps, int64_t block,
                        int64_t next_blocks) {
  static_assert(TILE_ROWS == 6, "the row remainders below count down from 6");
  const int64_t tiles = (num_rows + TILE_ROWS - 1) / TILE_ROWS;
  const int64_t block_bytes = steps * LANES * T::K * static_cast<int64_t>(sizeof(typename T::Elem));
  const char *next = reinterpret_cast<const char *>(packed) + (block + NB) * block_bytes;
  const int64_t next_lines = next_blocks * block_bytes / 64;
  for (int64_t m = 0; m < num_rows; m += TILE_ROWS) {
    typename T::Elem *y_m = y + m * y_stride;
    const typename T::Elem *x_m = x + m * x_stride;
    // Each tile asks for a share of the next panel in proportion to its rows: at 8 rows (6 + 2)
    // equal shares were 5% slower, and the whole panel from the short second tile alone, a burst,
    // 17-25%. A panel of one tile asks for nothing: at 1-6 rows the loop streams from memory at the
    // threads' pace (~29 GB/s here), and asking for the next panel beside it cost 2-6%.
    Prefetch pf;
    if (tiles > 1 && tiles <= PREFETCH_TILES) {
      const int64_t tile_rows = num_rows - m < TILE_ROWS ? num_rows - m : TILE_ROWS;
      const int64_t lo = m * next_lines / num_rows, hi = (m + tile_rows) * next_lines / num_rows;
      pf = {next + lo * 64, hi - lo};
    }
    switch (num_rows - m) {
      case 5: tile<T, 5, NB>(y_m, y_stride, x_m, x_stride, packed, steps, block, pf); break;
      case 4: tile<T, 4, NB>(y_m, y_stride, x_m, x_stride, packed, steps, block, pf); break;
      case 3: tile<T, 3, NB>(y_m, y_stride, x_m, x_stride, packed, steps, block, pf); break;
      case 2: tile<T, 2, NB>(y_m, y_stride, x_m, x_stride, packed, steps, block, pf); break;
      case 1: tile<T, 1, NB>(y_m, y_stride, x_m, x_stride, packed, steps, block, pf); break;
      default: tile<T, TILE_ROWS, NB>(y_m, y_stride, x_m, x_stride, packed, steps, block, pf);
    }
  }
}

// Blocks [first, last) for every row, ROW_BLOCK rows at a time: tiles of W blocks (BLOCKS, or 3
// where that splits a layer's blocks more evenly over the threads: linear() below), then the 1 to
// W-1 left over.
template <class T, int W = BLOCKS>
inline void block_range(typename T::Elem *y, int64_t y_stride, const typename T::Elem *x, int64_t x_stride,
                        const typename T::Elem *packed, int64_t num_rows, int64_t steps, int64_t first, int64_t last) {
  static_assert(BLOCKS == 4 && (W == 3 || W == 4), "the block remainders below count down from 4");
  for (int64_t m = 0; m < num_rows; m += ROW_BLOCK) {
    const int64_t rows = num_rows - m < ROW_BLOCK ? num_rows - m : ROW_BLOCK;
    typename T::Elem *y_m = y + m * y_stride;
    const typename T::Elem *x_m = x + m * x_stride;
    int64_t block = first;
    for (; block + W <= last; block += W) {
      const int64_t next = last - (block + W) < W ? last - (block + W) : W;
      blocks_rows<T, W>(y_m, y_stride, x_m, x_stride, packed, rows, steps, block, next);
    }
    switch (last - block) {
      case 3: blocks_rows<T, 3>(y_m, y_stride, x_m, x_stride, packed, rows, steps, block, 0); break;
      case 2: blocks_rows<T, 2>(y_m, y_stride, x_m, x_stride, packed, rows, steps, block, 0); break;
      case 1: blocks_rows<T, 1>(y_m, y_stride, x_m, x_stride, packed, rows, steps, block, 0); break;
      default: break;
    }
  }
}

// The most blocks one of `threads` threads takes when the tiles hold `width` blocks each.
inline int64_t busiest_blocks(int64_t blocks, int64_t width, int64_t threads) {
  const int64_t tiles = (blocks + width - 1) / width;
  return (tiles + threads - 1) / threads * width;
}

// Thread i's tiles of `width` blocks, as OpenMP's static schedule would split them, as blocks.
template <class T, int W>
inline void thread_tiles(typename T::Elem *y, int64_t y_stride, const typename T::Elem *x, int64_t x_stride,
                         const typename T::Elem *packed, int64_t num_rows, int64_t steps, int64_t blocks,
                         int64_t i, int64_t threads) {
  const int64_t tiles = (blocks + W - 1) / W, base = tiles / threads, extra = tiles % threads;
  const int64_t t0 = i * base + (i < extra ? i : extra), t1 = t0 + base + (i < extra);
  const int64_t last = t1 * W < blocks ? t1 * W : blocks;
  if (t0 < t1) block_range<T, W>(y, y_stride, x, x_stride, packed, num_rows, steps, t0 * W, last);
}

// The layer over `num_threads` threads (1: on the calling thread). Up to ROW_BLOCK rows (decode)
// the threads split the output tiles, so each weight comes from memory once; past it (prefill,
// compute-bound) each thread takes an even share of the rows through every output. Splitting
// decode's 16-output blocks evenly instead (SmolLM2's 576 outputs are 9 tiles: 5 against 4) left
// half-width tiles at the seams and measured slower end to end in bf16 (decode's layer matmuls
// 4.32-4.50 against 4.90-4.96 s); tiles of 3 whole blocks where they split more evenly (576 outputs:
// 12 tiles, 6 each, where 4-block tiles gave 5 against 4; 6 x 3 sums run at the 6 x 4 tile's speed
// from L2) measured faster from 13 rows on: 5-8% at 16-32 rows in bf16 and fp32, 3-6% over a
// draining batch; at 4-12 rows, where the loop streams from memory, 6-13% slower, so not there.
// Splitting prefill's rows in ROW_BLOCKs left the last block short (512 rows: 288 against 224,
// 10-15% behind oneDNN); even shares run level with it at 200-2,900 rows.
template <class T>
inline void linear(typename T::Elem *y, int64_t y_stride, const typename T::Elem *x, int64_t x_stride,
                   const typename T::Elem *packed, int64_t num_rows, int64_t out_features, int64_t in_features,
                   int num_threads) {
  const int64_t steps = in_features / T::K, blocks = out_features / LANES;
  if (num_threads == 1) {
    block_range<T>(y, y_stride, x, x_stride, packed, num_rows, steps, 0, blocks);
  } else if (num_rows <= ROW_BLOCK) {
    const bool narrow = num_rows > 2 * TILE_ROWS &&
                        busiest_blocks(blocks, 3, num_threads) < busiest_blocks(blocks, BLOCKS, num_threads);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_threads; ++i) {
      if (narrow)
        thread_tiles<T, 3>(y, y_stride, x, x_stride, packed, num_rows, steps, blocks, i, num_threads);
      else
        thread_tiles<T, BLOCKS>(y, y_stride, x, x_stride, packed, num_rows, steps, blocks, i, num_threads);
    }
  } else {
    // each thread an even share of the rows, in whole tiles of rows, through every output
    const int64_t share = ((num_rows + num_threads - 1) / num_threads + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_threads; ++i) {
      const int64_t m = i * share, rows = num_rows - m < share ? num_rows - m : share;
      if (rows > 0) block_range<T>(y + m * y_stride, y_stride, x + m * x_stride, x_stride, packed, rows, steps, 0, blocks);
    }
  }
}

#endif  // __AVX512F__

}  // namespace gemm
}  // namespace paged_cpu
