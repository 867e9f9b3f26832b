// The warp-level operations the emulator adds for kernels_cu/mma.cuh: __syncwarp, and the
// m16n8k16 tensor-core product computed from every lane's fragments. Each lane publishes its
// fragments in its warp's exchange area, waits for the whole warp, computes its own four outputs
// (products exact in fp32, summed in k order onto the accumulator; the hardware's order and
// rounding inside one instruction are unspecified, so results agree with a GPU to fp32 rounding),
// and waits again so the area can be reused.
#pragma once

#include <cstring>

inline void __syncwarp(unsigned = 0xffffffffu) { paged_emu::t_warp->sync.arrive_and_wait(); }

namespace paged_emu {

inline float to_float(__half h) { return __half2float(h); }
inline float to_float(__nv_bfloat16 b) { return __bfloat162float(b); }

template <typename T>
float half_of(unsigned word, int which) {
  T pair[2];
  std::memcpy(pair, &word, sizeof word);
  return to_float(pair[which]);
}

template <typename T>
void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  unsigned(*frags)[6] = t_warp->mma;
  for (int i = 0; i < 4; ++i) frags[t_lane][i] = a[i];
  frags[t_lane][4] = b[0];
  frags[t_lane][5] = b[1];
  t_warp->sync.arrive_and_wait();
  // A[row][k] from the lane holding it: rows g / g + 8 in registers 0,2 / 1,3; columns 2t..2t+1
  // in registers 0,1 and 2t+8..2t+9 in registers 2,3.
  auto a_at = [&](int row, int k) {
    const int lane = (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return half_of<T>(frags[lane][reg], k % 2);
  };
  auto b_at = [&](int k, int col) {
    const int lane = col * 4 + (k % 8) / 2;
    return half_of<T>(frags[lane][4 + (k >= 8 ? 1 : 0)], k % 2);
  };
  const int g = static_cast<int>(t_lane) / 4, t = static_cast<int>(t_lane) % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + i % 2;
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) sum += a_at(row, k) * b_at(k, col);
    d[i] += sum;
  }
  t_warp->sync.arrive_and_wait();
}

}  // namespace paged_emu
