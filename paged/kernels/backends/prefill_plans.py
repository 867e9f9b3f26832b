"""The prefill kernel's tiles (kernels_cu/prefill.cuh's `PrefillTiles`) and the dynamic shared memory
they take, for the cuda and emu backends' launches and the executor's description of the path."""

from __future__ import annotations

from typing import NamedTuple

import torch

from paged.kernels.backends.launch_api import VECTOR_BYTES

PREFILL_WARPS = 4  # kernels_cu/prefill.cuh's warps per CTA
# Its K/V tiles are double-buffered up to this many bytes of shared memory (sm_86 / sm_89 allow 99 KB).
PREFILL_TWO_STAGE_BYTES = 96 * 1024


class PrefillTiles(NamedTuple):
    """kernels_cu/prefill.cuh's `PrefillTiles`: query rows per CTA, keys per K/V tile, K/V buffers."""

    rows: int
    keys: int
    stages: int


def prefill_tiles(dtype: torch.dtype, head_size: int, cache_dtype: torch.dtype | None = None) -> PrefillTiles:
    """fp16 / bf16 up to head 128: two m16 row tiles per warp, 64-key tiles up to head 64 (else 32);
    head 256 and fp32 one row tile and 32 keys. Two K/V buffers where they fit in 96 KB, else one
    (`cache_dtype`: fp8 tiles are half the bytes)."""
    wide = dtype.itemsize == 2 and head_size <= 128
    rows, keys = (128 if wide else 64), (64 if wide and head_size <= 64 else 32)
    cache = cache_dtype or dtype
    two_stages = _prefill_bytes(dtype, cache, head_size, rows, keys, 2) <= PREFILL_TWO_STAGE_BYTES
    return PrefillTiles(rows, keys, 2 if two_stages else 1)


def _prefill_bytes(dtype: torch.dtype, cache: torch.dtype, head_size: int, rows: int, keys: int, stages: int) -> int:
    """The Q tile in `dtype`, then per stage a K and a Vᵀ tile in `cache`'s elements, rows padded by
    16 bytes (prefill.cuh)."""
    q_pad, kv_pad = VECTOR_BYTES // dtype.itemsize, VECTOR_BYTES // cache.itemsize
    stage = (keys * (head_size + kv_pad) + head_size * (keys + kv_pad)) * cache.itemsize
    return rows * (head_size + q_pad) * dtype.itemsize + stages * stage


def prefill_shared_memory(dtype: torch.dtype, head_size: int, cache_dtype: torch.dtype | None = None) -> int:
    """The prefill kernel's dynamic shared memory."""
    tiles = prefill_tiles(dtype, head_size, cache_dtype)
    return _prefill_bytes(dtype, cache_dtype or dtype, head_size, tiles.rows, tiles.keys, tiles.stages)
