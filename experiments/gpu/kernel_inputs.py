"""The decode benchmark's inputs (experiments/gpu/kernel_bench.py): vLLM-layout sets of query, K/V caches and
block tables at one batch shape, and the same data in the layouts
the peers read (kernel_peers.py).

Setup after vLLM's benchmark_paged_attention.py: 64 query / 8 KV heads (GQA 8), head 128, block 16,
random block tables, every sequence of the same length. Layouts, all holding the same bytes:
- ours (vLLM's): key `[blocks, kv_heads, head/x, block, x]`, value `[blocks, kv_heads, head, block]`;
- HND pages (FlashInfer's): K and V `[blocks, kv_heads, block, head]`;
- one paged sequence (FlexAttention's paged decode): K and V `[1, kv_heads, blocks * block, head]`;
- contiguous (SDPA): K and V `[batch, kv_heads, context, head]`, each row's blocks gathered in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged.kernels.testing import random_cache

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 64, 8, 128, 16
SCALE = HEAD_SIZE**-0.5


@dataclass(frozen=True)
class Inputs:
    """One set in our layout."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor


def kv_bytes(batch: int, context: int, kv_dtype: torch.dtype) -> int:
    """Unique K and V bytes one call reads."""
    return 2 * batch * context * NUM_KV_HEADS * HEAD_SIZE * kv_dtype.itemsize


def set_bytes(batch: int, context: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """Bytes of one set in our layout."""
    blocks = batch * -(-context // BLOCK_SIZE)
    return (kv_dtype.itemsize * 2 * blocks * NUM_KV_HEADS * HEAD_SIZE * BLOCK_SIZE
            + dtype.itemsize * batch * NUM_HEADS * HEAD_SIZE + 4 * blocks)


def random_set(batch: int, context: int, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> Inputs:
    """Random K/V caches in `kv_dtype` (an fp8 one from the `dtype` values, read with scales of 1), a
    random block table and a query."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    key_cache, value_cache = random_cache(num_blocks, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype, device=device)
    if kv_dtype != dtype:
        x = 16 // kv_dtype.itemsize
        key_cache = key_cache.transpose(2, 3).reshape(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE // x, x)
        key_cache, value_cache = key_cache.transpose(2, 3).contiguous().to(kv_dtype), value_cache.to(kv_dtype)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    query = torch.empty(batch, NUM_HEADS, HEAD_SIZE, dtype=dtype, device=device).uniform_(-SCALE, SCALE)
    return Inputs(query, key_cache, value_cache, tables)


def hnd_pages(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as `[blocks, kv_heads, block, head]`."""
    key = inputs.key_cache.permute(0, 1, 3, 2, 4).flatten(3)
    return key.contiguous(), inputs.value_cache.transpose(2, 3).contiguous()


def one_sequence(pages: torch.Tensor) -> torch.Tensor:
    """HND pages as one long sequence `[1, kv_heads, blocks * block, head]`: token t of block b at b * block + t."""
    return pages.transpose(0, 1).flatten(1, 2).unsqueeze(0).contiguous()


def contiguous(pages: torch.Tensor, tables: torch.Tensor, context: int) -> torch.Tensor:
    """HND pages gathered per row in table order: `[batch, kv_heads, context, head]`."""
    rows = pages[tables.long()]  # [batch, blocks_per_seq, kv_heads, block, head]
    return rows.transpose(1, 2).flatten(2, 3)[:, :, :context].contiguous()
