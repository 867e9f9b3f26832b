"""Attention and cache ops front end: one signature, four backends (torch, cuda, emu, cpu).

Tensors use vLLM's cache layout (DESIGN.md): key `[num_blocks, kv_heads, head_size/x, block_size, x]`
with `x = 16 // element_size`, value `[num_blocks, kv_heads, head_size, block_size]`. Shapes, dtypes
and devices are validated here, before any backend runs.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from functools import cache

import torch

from paged.kernels import torch_ref
from paged.kernels.backend import KernelBackend
from paged.kernels.validate import (
    BACKENDS,
    VERSIONS,
    check_backend,
    check_cache_pair,
    check_copy_blocks,
    check_paged_attention,
    check_reshape_and_cache,
)

__all__ = [
    "BACKENDS",
    "VERSIONS",
    "choose_version",
    "copy_blocks",
    "gather_kv",
    "paged_attention",
    "prefill_attention",
    "reshape_and_cache",
    "cpu_available",
    "resolve_backend",
]

log = logging.getLogger(__name__)

V1_MAX_SEQ_LEN = 8192
V1_MIN_PARALLELISM = 512


def choose_version(max_seq_len: int, num_seqs: int, num_heads: int, partition_size: int = 512) -> str:
    """vLLM's rule: v1 when one partition suffices or the grid already has enough blocks."""
    num_partitions = -(-max_seq_len // partition_size)
    use_v1 = max_seq_len <= V1_MAX_SEQ_LEN and (
        num_partitions == 1 or num_seqs * num_heads > V1_MIN_PARALLELISM
    )
    return "v1" if use_v1 else "v2"


@cache
def cpu_available() -> bool:
    """Whether the cpu backend's native library builds and loads here; checked once per process.

    A failure (no compiler, compiler error) is logged as a warning with its reason.
    """
    from paged.kernels import cpu_backend

    try:
        cpu_backend.load()
    except Exception as exc:  # noqa: BLE001 - any failure means: fall back to torch
        log.warning("native cpu attention unavailable, falling back to backend 'torch': %s", exc)
        return False
    return True


def resolve_backend(backend: str) -> str:
    """`auto` is `cuda` where a CUDA device exists, else `cpu` where its native library builds,
    else `torch`."""
    check_backend(backend, allow_auto=True)
    if backend == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "cpu" if cpu_available() else "torch"
    return backend


# Imported on first use: cuda needs cuda-python, emu and cpu a host compiler.
_BACKEND_MODULES = {"torch": "torch_ref", "cpu": "cpu_backend", "cuda": "cuda_backend", "emu": "emu_backend"}


def _backend(name: str) -> KernelBackend:
    return importlib.import_module(f"paged.kernels.{_BACKEND_MODULES[name]}").BACKEND


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    version: str = "v1",
    backend: str = "torch",
    partition_size: int = 512,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Decode attention, one query token per sequence: `[num_seqs, num_heads, head_size]`.

    `max_seq_len` may be passed when the caller knows it, which saves a device-to-host sync.
    """
    check_backend(backend)
    check_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, version, partition_size, backend
    )
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
    if query.shape[0] == 0 or max_seq_len == 0:
        return torch.zeros_like(query)
    return _backend(backend).paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, version, partition_size, max_seq_len
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "torch",
) -> None:
    """Write `key`/`value` `[num_tokens, kv_heads, head_size]` into the cache at `slot_mapping` (-1 skipped)."""
    check_backend(backend)
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, backend)
    _backend(backend).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor | Sequence[tuple[int, int]],
    *,
    backend: str = "torch",
) -> None:
    """Copy-on-write: for every `(src, dst)` pair copy block src to dst in every layer's K and V."""
    check_backend(backend)
    if not isinstance(block_mapping, torch.Tensor):
        block_mapping = torch.tensor(list(block_mapping), dtype=torch.int64).reshape(-1, 2)
    check_copy_blocks(key_caches, value_caches, block_mapping)
    _backend(backend).copy_blocks(key_caches, value_caches, block_mapping)


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K/V for positions `[0, context_len)`, read through its block table."""
    check_cache_pair(key_cache, value_cache)
    return torch_ref.gather_kv(key_cache, value_cache, block_table, context_len)


prefill_attention = torch_ref.prefill_attention
