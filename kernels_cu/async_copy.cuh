// 16- and 8-byte global -> shared copies that run behind the computation: PTX `cp.async` (sm_80 and
// newer) in commit groups, so a kernel can issue the loads of tile i + STAGES - 1 and compute tile
// i while they are in flight. Older targets and the emulator copy synchronously, which keeps the
// same program order (every wait is then already satisfied).
#pragma once

#include "compat.cuh"

#if (defined(__CUDACC__) || defined(__CUDACC_RTC__)) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define PAGED_HAS_CP_ASYNC 1
#else
#define PAGED_HAS_CP_ASYNC 0
#endif

namespace paged {

// Both addresses 16-byte aligned; .cg bypasses L1, as data read once should.
PAGED_DEVICE void cp_async16(void* smem, const void* gmem) {
#if PAGED_HAS_CP_ASYNC
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
#else
  *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}

// 8 bytes (an 8-token block of fp8 values), both addresses 8-byte aligned; .cg takes 16 only.
PAGED_DEVICE void cp_async8(void* smem, const void* gmem) {
#if PAGED_HAS_CP_ASYNC
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(gmem));
#else
  *reinterpret_cast<uint2*>(smem) = *reinterpret_cast<const uint2*>(gmem);
#endif
}

// Closes the group of copies issued since the last commit.
PAGED_DEVICE void cp_async_commit() {
#if PAGED_HAS_CP_ASYNC
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most PENDING of this thread's groups are still in flight; a __syncthreads after
// it publishes every thread's copies to the block.
template <int PENDING>
PAGED_DEVICE void cp_async_wait() {
#if PAGED_HAS_CP_ASYNC
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
#endif
}

}  // namespace paged
