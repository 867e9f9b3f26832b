"""The emulator runtime's two schedulers (kernels_cu/emu/runtime.h): fibers, the default, and one OS
thread per CUDA thread, which the sanitizer builds use and PAGED_EMU_OS_THREADS selects. Small
kernels pin what the attention kernels rely on and could break with a new scheduler: barriers in a
loop with shared memory between them, shuffles of every width, warps cut short by the block size,
the launch statuses and dynamic shared memory's fill, each under both schedulers."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import pytest

from paged.kernels.toolchain import emulator, host_compiler

pytestmark = pytest.mark.compiles

SOURCE = r"""
#include "compat.cuh"

// Each round, every thread publishes a value in shared memory, reads two neighbours' after a
// barrier, and must not overwrite its own before they read it (the second barrier).
__global__ void ring(const float* in, float* out, int rounds) {
  __shared__ float values[1024];
  const unsigned t = threadIdx.x, n = blockDim.x;
  float v = in[blockIdx.x * n + t];
  for (int r = 0; r < rounds; ++r) {
    values[t] = v;
    __syncthreads();
    v = 0.5f * values[(t + 1) % n] + 0.25f * values[(t + n - 1) % n] + 0.125f * v;
    __syncthreads();
  }
  out[blockIdx.x * n + t] = v;
}

// Per thread: the xor-butterfly sums at widths 32 (full warps only), 16 and 8, and a rotation by
// three lanes within each width; then a __syncwarp and a block barrier in the same loop.
__global__ void shuffles(const int* in, int* out, int rounds) {
  const unsigned t = threadIdx.x;
  const bool full_warp = t / 32 < blockDim.x / 32;
  int v = in[blockIdx.x * blockDim.x + t];
  int* row = out + (blockIdx.x * blockDim.x + t) * 6;
  for (int r = 0; r < rounds; ++r) {
    int k = 0;
    for (int width = 32; width >= 8; width /= 2) {
      if (width == 32 && !full_warp) {
        k += 2;
        continue;
      }
      int sum = v;
      for (int mask = width / 2; mask > 0; mask /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, mask, width);
      const int lane = static_cast<int>(t % 32) % width;
      const int rotated = __shfl_sync(0xffffffffu, v, (lane + 3) % width, width);
      row[k++] += sum;
      row[k++] += rotated;
    }
    __syncwarp();
    v = v * 3 + 1;
    __syncthreads();
  }
}

__global__ void dynamic_bytes(unsigned char* out, int n) {
  const unsigned char* smem = reinterpret_cast<const unsigned char*>(paged::dynamic_smem());
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[blockIdx.x * n + i] = smem[i];
}

// Where each thread of a 3-D block finds itself, and the block's shape.
__global__ void coordinates(unsigned* out) {
  const unsigned flat = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  const unsigned block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  unsigned* row = out + (block * blockDim.x * blockDim.y * blockDim.z + flat) * 3;
  row[0] = threadIdx.x + 10 * threadIdx.y + 100 * threadIdx.z;
  row[1] = blockIdx.x + 10 * blockIdx.y + 100 * blockIdx.z;
  row[2] = blockDim.x + 10 * blockDim.y + 100 * blockDim.z;
}

PAGED_EMU_EXPORT(test_ring, ring)
PAGED_EMU_EXPORT(test_shuffles, shuffles)
PAGED_EMU_EXPORT(test_dynamic_bytes, dynamic_bytes)
PAGED_EMU_EXPORT(test_coordinates, coordinates)
"""

SCHEDULERS = {"fibers": (), "os_threads": ("-DPAGED_EMU_OS_THREADS",)}


@pytest.fixture(scope="module", params=list(SCHEDULERS))
def library(request: pytest.FixtureRequest) -> ctypes.CDLL:
    try:
        host_compiler.find_compiler()
    except host_compiler.CompilerNotFoundError as e:
        pytest.skip(f"emu backend unavailable: {e}")
    return ctypes.CDLL(str(emulator.compile_shared_library(SOURCE, emulator.FLAGS + SCHEDULERS[request.param])))


Launcher = Callable[..., int]


def _launcher(library: ctypes.CDLL, name: str) -> Launcher:
    fn = getattr(library, name)
    fn.argtypes = [ctypes.POINTER(emulator.LaunchDims), ctypes.POINTER(ctypes.c_void_p)]
    fn.restype = ctypes.c_int

    def launch(grid: tuple[int, int, int], block: tuple[int, int, int], *args: object, smem: int = 0) -> int:
        values = [ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray) else ctypes.c_int(a) for a in args]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        dims = emulator.LaunchDims((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem)
        return int(fn(ctypes.byref(dims), pointers))

    return launch


def _ring_reference(values: np.ndarray, rounds: int) -> np.ndarray:
    v = values.astype(np.float32)
    for _ in range(rounds):
        neighbours = np.float32(0.5) * np.roll(v, -1, axis=1) + np.float32(0.25) * np.roll(v, 1, axis=1)
        v = neighbours + np.float32(0.125) * v
    return v


@pytest.mark.parametrize("threads", [1, 31, 100, 1024])
def test_barriers_in_a_loop_order_shared_memory(library: ctypes.CDLL, threads: int) -> None:
    blocks, rounds = 3, 7
    values = np.random.default_rng(threads).standard_normal((blocks, threads)).astype(np.float32)
    out = np.zeros_like(values)
    assert _launcher(library, "test_ring")((blocks, 1, 1), (threads, 1, 1), values, out, rounds) == 0
    np.testing.assert_allclose(out, _ring_reference(values, rounds), rtol=1e-6)


def _shuffles_reference(values: np.ndarray, rounds: int) -> np.ndarray:
    blocks, threads = values.shape
    full_warps = threads // 32
    out = np.zeros((blocks, threads, 6), dtype=np.int64)
    v = values.astype(np.int64)
    for _ in range(rounds):
        for b in range(blocks):
            for t in range(threads):
                for k, width in enumerate((32, 16, 8)):
                    if width == 32 and t // 32 >= full_warps:
                        continue
                    start = t - (t % 32) % width
                    out[b, t, 2 * k] += v[b, start:start + width].sum()
                    out[b, t, 2 * k + 1] += v[b, start + ((t % 32) % width + 3) % width]
        v = v * 3 + 1
    return out


# 80 threads: two full warps and a 16-lane one, which shuffles at widths 16 and 8 only.
@pytest.mark.parametrize("threads", [32, 80])
def test_shuffles_at_widths_32_16_8(library: ctypes.CDLL, threads: int) -> None:
    blocks, rounds = 2, 3
    values = np.random.default_rng(threads).integers(-1000, 1000, (blocks, threads)).astype(np.int32)
    out = np.zeros((blocks, threads, 6), dtype=np.int32)
    assert _launcher(library, "test_shuffles")((blocks, 1, 1), (threads, 1, 1), values, out, rounds) == 0
    np.testing.assert_array_equal(out, _shuffles_reference(values, rounds).astype(np.int32))


def test_three_dimensional_blocks_and_grids(library: ctypes.CDLL) -> None:
    grid, block = (2, 3, 2), (5, 4, 3)
    out = np.zeros((2 * 3 * 2, 5 * 4 * 3, 3), dtype=np.uint32)
    assert _launcher(library, "test_coordinates")(grid, block, out) == 0
    for bz in range(2):
        for by in range(3):
            for bx in range(2):
                rows = out[(bz * 3 + by) * 2 + bx]
                expected = [[x + 10 * y + 100 * z, bx + 10 * by + 100 * bz, 5 + 40 + 300]
                            for z in range(3) for y in range(4) for x in range(5)]
                np.testing.assert_array_equal(rows, np.array(expected, dtype=np.uint32))


def test_dynamic_shared_memory_starts_filled_with_ones(library: ctypes.CDLL) -> None:
    n = 1000
    out = np.zeros((2, n), dtype=np.uint8)
    assert _launcher(library, "test_dynamic_bytes")((2, 1, 1), (64, 1, 1), out, n, smem=n) == 0
    assert (out == 0xff).all()


@pytest.mark.parametrize(
    ("grid", "block", "status"),
    [((1, 1, 1), (0, 1, 1), 1), ((1, 1, 1), (1025, 1, 1), 1), ((1, 1, 1), (32, 32, 2), 1),
     ((0, 1, 1), (32, 1, 1), 2), ((1, 1, 0), (32, 1, 1), 2)],
)
def test_bad_launches_are_refused(
    library: ctypes.CDLL, grid: tuple[int, int, int], block: tuple[int, int, int], status: int
) -> None:
    out = np.zeros(16, dtype=np.uint32)
    assert _launcher(library, "test_coordinates")(grid, block, out) == status
    assert not out.any()
