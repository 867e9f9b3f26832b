// CPU execution of CUDA kernels. Every CUDA thread of a block is a real std::thread, so a kernel
// keeps CUDA's semantics and ThreadSanitizer can check it: __syncthreads is a block-wide
// std::barrier, a warp shuffle publishes the value then waits on a warp-wide std::barrier.
// Blocks of a grid run one after another on the same threads; a barrier between blocks makes the
// reuse of (static) shared memory safe.
#pragma once

#include <math.h>

#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "half.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __align__(n) alignas(n)
// Function-local statics give one copy per kernel instantiation shared by the block's threads,
// which is what __shared__ means while blocks run one at a time.
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
// Written by the launching thread before the workers start and read-only while they run.
inline dim3 blockDim;
inline dim3 gridDim;

inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }

namespace paged_emu {

constexpr unsigned kWarpSize = 32;
constexpr unsigned kMaxThreads = 1024;

struct Warp {
  explicit Warp(std::ptrdiff_t lanes) : sync(lanes) {}
  std::barrier<> sync;
  // Two slot sets used alternately: a lane can publish shuffle k+1 while a slower lane still
  // reads shuffle k, yet cannot reach shuffle k+2 before every lane passed shuffle k+1's barrier.
  std::uint64_t slots[2][kWarpSize] = {};
  // Each lane's tensor-core fragments (four A registers, two B) while a warp_mma.h product runs.
  unsigned mma[kWarpSize][6] = {};
};

struct Block {
  Block(unsigned threads, std::size_t smem_bytes) : sync(threads), smem((smem_bytes + 15) / 16) {
    for (unsigned first = 0; first < threads; first += kWarpSize) {
      const unsigned lanes = threads - first < kWarpSize ? threads - first : kWarpSize;
      warps.push_back(std::make_unique<Warp>(lanes));
    }
    // Uninitialised shared memory reads as NaN, so a kernel relying on it fails its test. A launch
    // without dynamic shared memory has no buffer: memset on its null data() is undefined (UBSan).
    if (!smem.empty()) std::memset(static_cast<void*>(smem.data()), 0xff, smem.size() * sizeof(uint4));
  }
  std::barrier<> sync;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<uint4> smem;
};

inline Block* g_block = nullptr;
inline thread_local Warp* t_warp = nullptr;
inline thread_local unsigned t_lane = 0;
inline thread_local unsigned t_phase = 0;

inline char* dynamic_smem() { return reinterpret_cast<char*>(g_block->smem.data()); }

template <typename T>
T exchange(T value, unsigned src_lane) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t) && std::is_trivially_copyable_v<T>);
  t_phase ^= 1u;
  std::uint64_t* slots = t_warp->slots[t_phase];
  std::memcpy(&slots[t_lane], &value, sizeof(T));
  t_warp->sync.arrive_and_wait();
  T result;
  std::memcpy(&result, &slots[src_lane], sizeof(T));
  return result;
}

// The launch description mirrors cudaLaunchKernel: dims, dynamic shared memory and an array of
// pointers to the argument values.
struct LaunchDims {
  unsigned grid[3];
  unsigned block[3];
  unsigned long long smem;
};

enum LaunchStatus : int { kOk = 0, kBadBlock = 1, kBadGrid = 2 };

template <typename... P, std::size_t... I>
void invoke(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cvref_t<P>*>(args[I])...);
}

template <typename... P>
int launch(void (*kernel)(P...), const LaunchDims& dims, void** args) {
  const unsigned threads = dims.block[0] * dims.block[1] * dims.block[2];
  if (threads == 0 || threads > kMaxThreads) return kBadBlock;
  if (dims.grid[0] == 0 || dims.grid[1] == 0 || dims.grid[2] == 0) return kBadGrid;
  gridDim = dim3{dims.grid[0], dims.grid[1], dims.grid[2]};
  blockDim = dim3{dims.block[0], dims.block[1], dims.block[2]};
  Block block(threads, dims.smem);
  g_block = &block;
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      threadIdx = dim3{t % dims.block[0], (t / dims.block[0]) % dims.block[1],
                       t / (dims.block[0] * dims.block[1])};
      t_warp = block.warps[t / kWarpSize].get();
      t_lane = t % kWarpSize;
      t_phase = 0;
      for (unsigned z = 0; z < dims.grid[2]; ++z) {
        for (unsigned y = 0; y < dims.grid[1]; ++y) {
          for (unsigned x = 0; x < dims.grid[0]; ++x) {
            blockIdx = dim3{x, y, z};
            invoke(kernel, args, std::index_sequence_for<P...>{});
            block.sync.arrive_and_wait();
          }
        }
      }
    });
  }
  for (std::thread& worker : workers) worker.join();
  g_block = nullptr;
  return kOk;
}

}  // namespace paged_emu

inline void __syncthreads() { paged_emu::g_block->sync.arrive_and_wait(); }

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask, int width = 32) {
  const unsigned lane = paged_emu::t_lane;
  const unsigned segment = lane & ~static_cast<unsigned>(width - 1);
  return paged_emu::exchange(value, segment | ((lane ^ lane_mask) & (width - 1)));
}

template <typename T>
T __shfl_sync(unsigned, T value, int src_lane, int width = 32) {
  const unsigned segment = paged_emu::t_lane & ~static_cast<unsigned>(width - 1);
  return paged_emu::exchange(value, segment | (src_lane & (width - 1)));
}

#include "math_intrinsics.h"
#include "warp_mma.h"

// One exported C entry point per kernel instantiation, called from Python through ctypes.
#define PAGED_EMU_EXPORT(symbol, ...)                                                   \
  extern "C" int symbol(const paged_emu::LaunchDims* dims, void** args) {             \
    return paged_emu::launch(&__VA_ARGS__, *dims, args);                               \
  }
