"""Argument checks shared by every backend, run before any launch so errors name the bad value."""

from __future__ import annotations

import torch

BACKENDS = ("torch", "cuda", "emu", "cpu")
VERSIONS = ("v1", "v2")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NATIVE_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
NATIVE_BLOCK_SIZES = (8, 16, 32)
# v2 partitions of the native kernels: whole blocks of every native block size, logits in 4 KB of
# shared memory at most.
NATIVE_PARTITION_SIZES = (32, 64, 128, 256, 512, 1024)


def check_backend(backend: str, *, allow_auto: bool = False) -> None:
    allowed = (*BACKENDS, "auto") if allow_auto else BACKENDS
    if backend not in allowed:
        raise ValueError(f"backend={backend!r} is not supported; allowed: {', '.join(allowed)}")


def _dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")


def _index(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    if t.dtype != dtype or t.dim() != ndim:
        raise TypeError(f"{name} must be a {ndim}-d {dtype} tensor, got {t.dim()}-d {t.dtype}")


def _same_device(*named: tuple[str, torch.Tensor]) -> None:
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        listing = ", ".join(f"{n} on {t.device}" for n, t in named)
        raise ValueError(f"tensors must share one device: {listing}")


def _native_device(backend: str, t: torch.Tensor) -> None:
    if backend == "cuda" and t.device.type != "cuda":
        raise ValueError(f"backend='cuda' needs CUDA tensors, got tensors on {t.device}")
    if backend in ("emu", "cpu") and t.device.type != "cpu":
        raise ValueError(f"backend={backend!r} runs on the CPU and needs CPU tensors, got {t.device}")


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Returns (num_blocks, num_kv_heads, head_size, block_size) of a valid K/V cache pair."""
    _dtype("key_cache", key_cache)
    if key_cache.dim() != 5:
        raise ValueError(
            f"key_cache must be [num_blocks, num_kv_heads, head_size/x, block_size, x], got {tuple(key_cache.shape)}"
        )
    num_blocks, num_kv_heads, d_over_x, block_size, x = key_cache.shape
    expected_x = 16 // key_cache.element_size()
    if x != expected_x:
        raise ValueError(f"key_cache last dim x={x}, expected 16 // element_size = {expected_x}")
    head_size = d_over_x * x
    expected_v = (num_blocks, num_kv_heads, head_size, block_size)
    if tuple(value_cache.shape) != expected_v:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} does not match key_cache; expected {expected_v}"
        )
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache dtype {value_cache.dtype} != key_cache dtype {key_cache.dtype}")
    _same_device(("key_cache", key_cache), ("value_cache", value_cache))
    return num_blocks, num_kv_heads, head_size, block_size


def _check_native_shape(
    backend: str, head_size: int, block_size: int, partition_size: int | None = None
) -> None:
    if backend == "torch":
        return
    if backend == "cpu":
        # the C++ loops take any head_size (a multiple of x, checked with the cache) and block size;
        # partitions need only be whole blocks, checked by the caller
        return
    if head_size not in NATIVE_HEAD_SIZES:
        raise ValueError(
            f"head_size={head_size} is not supported by backend={backend!r}; supported: "
            f"{', '.join(map(str, NATIVE_HEAD_SIZES))}"
        )
    if block_size not in NATIVE_BLOCK_SIZES:
        raise ValueError(
            f"block_size={block_size} is not supported by backend={backend!r}; supported: "
            f"{', '.join(map(str, NATIVE_BLOCK_SIZES))}"
        )
    if partition_size is not None and partition_size not in NATIVE_PARTITION_SIZES:
        raise ValueError(
            f"partition_size={partition_size} is not supported by backend={backend!r}; supported: "
            f"{', '.join(map(str, NATIVE_PARTITION_SIZES))}"
        )


def check_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    version: str,
    partition_size: int,
    backend: str,
) -> None:
    if version not in VERSIONS:
        raise ValueError(f"version={version!r} is not supported; allowed: v1, v2")
    _, num_kv_heads, head_size, block_size = check_cache_pair(key_cache, value_cache)
    _dtype("query", query)
    if query.dtype != key_cache.dtype:
        raise TypeError(f"query dtype {query.dtype} != cache dtype {key_cache.dtype}")
    if query.dim() != 3 or query.shape[2] != head_size:
        raise ValueError(f"query must be [num_seqs, num_heads, {head_size}], got {tuple(query.shape)}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads={query.shape[1]} is not a multiple of num_kv_heads={num_kv_heads}")
    _index("block_tables", block_tables, torch.int32, 2)
    _index("seq_lens", seq_lens, torch.int32, 1)
    num_seqs = query.shape[0]
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"query has {num_seqs} sequences but block_tables has {block_tables.shape[0]} rows "
            f"and seq_lens {seq_lens.shape[0]} entries"
        )
    if partition_size <= 0 or partition_size % block_size:
        raise ValueError(f"partition_size={partition_size} must be a positive multiple of block_size={block_size}")
    _check_native_shape(backend, head_size, block_size, partition_size if version == "v2" else None)
    _same_device(
        ("query", query), ("key_cache", key_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)
    )
    _native_device(backend, query)


def check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str,
) -> None:
    _, num_kv_heads, head_size, block_size = check_cache_pair(key_cache, value_cache)
    expected = (key.shape[0], num_kv_heads, head_size)
    if key.dim() != 3 or tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key/value must be [num_tokens, {num_kv_heads}, {head_size}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype:
        raise TypeError(f"key/value dtypes {key.dtype}/{value.dtype} != cache dtype {key_cache.dtype}")
    _index("slot_mapping", slot_mapping, torch.int64, 1)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    _check_native_shape(backend, head_size, block_size)
    _same_device(("key", key), ("value", value), ("key_cache", key_cache), ("slot_mapping", slot_mapping))
    _native_device(backend, key)


def check_copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    if len(key_caches) != len(value_caches) or not key_caches:
        raise ValueError(
            f"need one key and one value cache per layer, got {len(key_caches)} and {len(value_caches)}"
        )
    num_blocks = check_cache_pair(key_caches[0], value_caches[0])[0]
    for k, v in zip(key_caches, value_caches):
        if k.shape != key_caches[0].shape or check_cache_pair(k, v)[0] != num_blocks:
            raise ValueError("all layers' caches must have the same shape")
    if block_mapping.dtype != torch.int64 or block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise TypeError(f"block_mapping must be an int64 [num_pairs, 2] tensor, got {block_mapping.dtype} "
                        f"{tuple(block_mapping.shape)}")
    if block_mapping.numel() and (int(block_mapping.min()) < 0 or int(block_mapping.max()) >= num_blocks):
        raise ValueError(f"block_mapping ids must be in [0, {num_blocks}), got {block_mapping.tolist()}")
