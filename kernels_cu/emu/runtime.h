// CPU execution of CUDA kernels with CUDA's semantics: __syncthreads is a block-wide barrier, a
// warp shuffle publishes the value then waits on a warp-wide barrier, __shared__ arrays are shared
// by the block. Blocks of a grid run one after another on the same CUDA threads; a barrier between
// blocks makes the reuse of (static) shared memory safe.
//
// Two schedulers run a block's CUDA threads, chosen at compile time:
//   fibers (fibers.h, the default): cooperative, on the launching OS thread, switching only at a
//     barrier. Fast, and deterministic.
//   real OS threads, one per CUDA thread, with std::barrier: under ThreadSanitizer, which must see
//     real threads to report a missing barrier as a race, and under AddressSanitizer, which loses
//     track of the stack when ucontext switches it. PAGED_EMU_OS_THREADS selects them elsewhere
//     (a test keeps this path built and run).
// Everything else (the per-thread state, exchange, warp_mma.h) is shared: the schedulers differ in
// their Barrier type, in how a thread's state is kept (thread_local, or globals that a fiber
// switch saves and restores) and in how the threads are started.
#pragma once

#include <math.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "half.h"

// GCC announces the sanitizers with __SANITIZE_*__, clang through __has_feature.
#if defined(PAGED_EMU_OS_THREADS) || defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define PAGED_EMU_USE_OS_THREADS 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define PAGED_EMU_USE_OS_THREADS 1
#endif
#endif

#if defined(PAGED_EMU_USE_OS_THREADS)
#include <barrier>
#include <thread>
// Each OS thread holds its CUDA thread's state.
#define PAGED_EMU_THREAD_STATE thread_local
#define PAGED_EMU_SCHEDULER paged_emu_os_threads
#else
// One fiber runs at a time; a switch saves and restores these globals (fibers.h), which are
// cheaper to reach than thread_local variables in a shared library.
#define PAGED_EMU_THREAD_STATE
#define PAGED_EMU_SCHEDULER paged_emu_fibers
#endif

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

// The runtime's variables live in a namespace named after the scheduler: the dynamic linker makes
// an inline variable one object across every library of a process (STB_GNU_UNIQUE), and a library
// of each scheduler loaded together (tests/test_emu_scheduler.py) must not share a thread_local
// and a plain global of one name.
inline namespace PAGED_EMU_SCHEDULER {
inline PAGED_EMU_THREAD_STATE dim3 threadIdx;
inline PAGED_EMU_THREAD_STATE dim3 blockIdx;
// Written by the launching thread before the CUDA threads start and read-only while they run.
inline dim3 blockDim;
inline dim3 gridDim;
}  // namespace PAGED_EMU_SCHEDULER

inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }

#if !defined(PAGED_EMU_USE_OS_THREADS)
#include "fibers.h"
#endif

namespace paged_emu {

constexpr unsigned kWarpSize = 32;
constexpr unsigned kMaxThreads = 1024;

#if defined(PAGED_EMU_USE_OS_THREADS)
using Barrier = std::barrier<>;
#else
using Barrier = FiberBarrier;
#endif

struct Warp {
  explicit Warp(std::ptrdiff_t lanes) : sync(lanes) {}
  Barrier sync;
  // Two slot sets used alternately: a lane can publish shuffle k+1 while a slower lane still
  // reads shuffle k, yet cannot reach shuffle k+2 before every lane passed shuffle k+1's barrier.
  std::uint64_t slots[2][kWarpSize] = {};
  // The slot set each lane used last (kept here rather than with the thread: fewer per-thread
  // variables for a fiber switch to save).
  unsigned phase[kWarpSize] = {};
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
  Barrier sync;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<uint4> smem;
};

inline namespace PAGED_EMU_SCHEDULER {
inline Block* g_block = nullptr;
inline PAGED_EMU_THREAD_STATE Warp* t_warp = nullptr;
inline PAGED_EMU_THREAD_STATE unsigned t_lane = 0;
}  // namespace PAGED_EMU_SCHEDULER

#if !defined(PAGED_EMU_USE_OS_THREADS)
// Every PAGED_EMU_THREAD_STATE variable, for fibers.h's switch.
inline ThreadState save_thread_state() { return ThreadState{threadIdx, blockIdx, t_warp, t_lane}; }
inline void restore_thread_state(const ThreadState& state) {
  threadIdx = state.thread_idx;
  blockIdx = state.block_idx;
  t_warp = state.warp;
  t_lane = state.lane;
}
#endif

inline char* dynamic_smem() { return reinterpret_cast<char*>(g_block->smem.data()); }

template <typename T>
T exchange(T value, unsigned src_lane) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t) && std::is_trivially_copyable_v<T>);
  const unsigned phase = t_warp->phase[t_lane] ^= 1u;
  std::uint64_t* slots = t_warp->slots[phase];
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
struct LaunchContext {
  void (*kernel)(P...);
  const LaunchDims& dims;
  void** args;
  Block& block;
};

// One CUDA thread's whole launch: every block of the grid in turn.
template <typename... P>
void run_thread(void* context, unsigned t) {
  const LaunchContext<P...>& launch = *static_cast<const LaunchContext<P...>*>(context);
  const LaunchDims& dims = launch.dims;
  threadIdx = dim3{t % dims.block[0], (t / dims.block[0]) % dims.block[1], t / (dims.block[0] * dims.block[1])};
  t_warp = launch.block.warps[t / kWarpSize].get();
  t_lane = t % kWarpSize;
  for (unsigned z = 0; z < dims.grid[2]; ++z) {
    for (unsigned y = 0; y < dims.grid[1]; ++y) {
      for (unsigned x = 0; x < dims.grid[0]; ++x) {
        blockIdx = dim3{x, y, z};
        invoke(launch.kernel, launch.args, std::index_sequence_for<P...>{});
        launch.block.sync.arrive_and_wait();
      }
    }
  }
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
  LaunchContext<P...> context{kernel, dims, args, block};
#if defined(PAGED_EMU_USE_OS_THREADS)
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) workers.emplace_back(run_thread<P...>, &context, t);
  for (std::thread& worker : workers) worker.join();
#else
  scheduler().run(threads, run_thread<P...>, &context);
#endif
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
