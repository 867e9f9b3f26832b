// Decode v3's per-thread state and what its two split paths share (decode_v3.h's portable one,
// decode_v3_grouped.h's AVX-512 one): the constants, the scratch, the tile prefetch and the
// split's last step, which sums the lane-folded value sums and normalises them.
#pragma once

#include "common.h"

namespace paged_cpu {

// Mirrors paged/kernels/split_plan.py's MAX_SPLITS: bounds the scratch a plan can ask for.
constexpr int kMaxSplits = 256;
// A head's reference max is raised this far above a new block max when it must move. Rescaling
// the partial sums costs as much as a block's V work, and under ALiBi (logits rising toward the
// query) the max would move on nearly every block; with the slack it moves a few times per
// sequence. exp(logit - reference) stays <= 1, so exp_nonpositive applies; fp32's relative
// precision does not depend on the scale, and only terms below e^-(87 - 16) of the largest, far
// under its rounding, flush to 0.
constexpr float kRescaleSlack = 16.f;

// Width of v3's lane-folded sums (v3_values): 8 floats, one AVX2 vector (two NEON ones). Every
// block size is a multiple of it.
constexpr int kLanes = 8;
// The grouped path's lanes (tile_lanes: up to 16).
constexpr int kTileMaxLanes = 16;

struct SplitArgs {
  int num_splits, split_blocks;
};

struct V3Scratch {
  std::vector<float> q;      // [D]: one query head
  std::vector<float> qx;     // [G][D/x][W]: each head's query chunks, repeated to W = max(x, kLanes)
  std::vector<float> kt;     // [D/x][BS][x]: a non-fp32 K tile as fp32
  std::vector<float> vt;     // [D][BS]: a V tile as fp32, 0 where masked
  std::vector<uint16_t> qb;  // [G][D]: the bf16 query (the grouped bf16 path)
  std::vector<float> qf;     // [G][D]: the fp32 query (the grouped fp32 path)
  std::vector<float> p;      // [G][BS], grouped path [G][kGroupSlots]: logits, then weights
  std::vector<float> vacc;   // [G][D][E]: sums of weighted values, the slots folded onto E lanes
  std::vector<float> ref, sum;  // [G]: reference max (-inf: nothing seen yet) and exp-sum
  std::vector<float> o;      // [G][D]: the split's normalised output
  std::vector<char> sees;    // [G]: block-sparse, whether each head sees the current block

  void init(int G, int D, int BS) {
    const size_t tile = static_cast<size_t>(D) * BS;
    q.resize(D);
    qx.resize(static_cast<size_t>(G) * D * 2);  // W / x <= kLanes / 4
    kt.resize(tile);
    vt.resize(tile);
    qb.resize(static_cast<size_t>(G) * D);
    qf.resize(static_cast<size_t>(G) * D);
    p.resize(static_cast<size_t>(G) * std::max(BS, kGroupSlots));
    vacc.assign(static_cast<size_t>(G) * D * std::max(kLanes, kTileMaxLanes), 0.f);
    ref.resize(G);
    sum.resize(G);
    o.resize(static_cast<size_t>(G) * D);
    sees.resize(G);
  }
};

// Raises head g's reference max to `max` + kRescaleSlack when `max` passes it, rescaling its
// exp-sum and its `n` partial value sums (none yet while the reference is -inf).
inline void raise_reference(V3Scratch& s, int g, float max, int64_t n) {
  const float old_ref = s.ref[g];
  if (!(max > old_ref)) return;
  const float new_ref = max + kRescaleSlack;
  if (old_ref != -std::numeric_limits<float>::infinity()) {
    const float alpha = std::exp(old_ref - new_ref);
    float* acc = s.vacc.data() + g * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) acc[j] *= alpha;
    s.sum[g] *= alpha;
  }
  s.ref[g] = new_ref;
}

// Asks for the next block's K and V tiles while this one is computed: the block table scatters
// the tiles, so the hardware prefetcher, which follows streams, cannot anticipate the jump.
// `locality`: __builtin_prefetch's, 3 into L1, 1 into L2 only.
template <typename C, int locality = 3>
inline void prefetch_tiles(const Args& a, int64_t block, int kvh) {
  const int64_t bytes = static_cast<int64_t>(a.head_size) * a.block_size * sizeof(typename C::storage);
  const char* k = reinterpret_cast<const char*>(tile_ptr<C>(a.key_cache, a, block, kvh));
  const char* v = reinterpret_cast<const char*>(tile_ptr<C>(a.value_cache, a, block, kvh));
  for (int64_t at = 0; at < bytes; at += 64) {
    __builtin_prefetch(k + at, 0, locality);
    __builtin_prefetch(v + at, 0, locality);
  }
}

// The split's end: s.o[g] = the sums of head g's value lanes (E per dim) over its exp-sum (0 for
// a head that saw nothing); the sums are zeroed for the next split.
template <int E>
inline void v3_finish(V3Scratch& s, int G, int D) {
  for (int g = 0; g < G; ++g) {
    float* acc = s.vacc.data() + static_cast<int64_t>(g) * D * E;
    const float inv = s.sum[g] > 0.f ? 1.f / s.sum[g] : 0.f;
    for (int d = 0; d < D; ++d) {
      float total = 0.f;
      for (int i = 0; i < E; ++i) total += acc[d * E + i];
      s.o[g * D + d] = total * inv;
    }
    std::fill(acc, acc + static_cast<int64_t>(D) * E, 0.f);
  }
}

}  // namespace paged_cpu
