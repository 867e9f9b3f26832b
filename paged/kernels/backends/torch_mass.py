"""Attention mass in torch, the reference of `KernelBackend.attention_mass`: how much attention each
cached token draws, per KV head, for the presses that score tokens by it (`paged.memory.press`:
snapkv, h2o).

The attention ops (`paged_attention`, `prefill_attention`) return outputs only, so that the default
step stays as fast as it is; when a press asks, the step also runs this op over the same queries and
the same paged cache: the softmax weights of each sequence's last `last_queries` queries (all of
them with None), causal in KV index, summed over those queries and over the query heads of each KV
group. A token past the sequence's length draws 0. Torch on whatever device the cache is on; the cpu
backend has a native kernel (kernels_cu/cpu/attention_mass.h), the cuda and emu backends a CUDA one
(kernels_cu/attention_mass.cuh, `mass_plan`).
"""

from __future__ import annotations

import numpy as np
import torch

from paged.kernels.backends.interface import CacheView


def _held_keys(cache: CacheView, row: int, length: int) -> torch.Tensor:
    """Row `row`'s first `length` cached keys, fp32 `[Hk, length, D]` (dequantised for fp8)."""
    bs = cache.block_size
    blocks = cache.block_tables[row, : -(-length // bs)].long()
    k = cache.key_cache[blocks].float().permute(1, 0, 3, 2, 4)  # [Hk, blocks, bs, d/x, x]
    k = k.reshape(cache.num_kv_heads, blocks.shape[0] * bs, -1)[:, :length]
    if cache.fp8:
        k = k * cache.k_scale.view(-1, 1, 1)
    return k


def attention_mass(
    query: torch.Tensor, cache: CacheView, query_start_loc: np.ndarray, scale: float,
    last_queries: int | None = None, soft_cap: float | None = None,
) -> torch.Tensor:
    """fp32 `[num_seqs, num_kv_heads, max_seq_len]`: row i's mass on each of its `seq_lens[i]` cached
    tokens, from its queries `query[query_start_loc[i]:query_start_loc[i + 1]]` (the last of its
    context, already cached), of which the last `last_queries` count."""
    seq_lens = cache.seq_lens.cpu().numpy()
    num_heads, num_kv_heads = query.shape[1], cache.num_kv_heads
    group = num_heads // num_kv_heads
    mass = torch.zeros(len(seq_lens), num_kv_heads, int(seq_lens.max()), dtype=torch.float32, device=query.device)
    for row, length in enumerate(seq_lens.tolist()):
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        if last_queries is not None:
            start = max(start, end - last_queries)
        q = query[start:end].float().view(end - start, num_kv_heads, group, -1).permute(1, 0, 2, 3)
        k = _held_keys(cache, row, length)
        logits = torch.matmul(q.reshape(num_kv_heads, -1, q.shape[-1]), k.transpose(1, 2)).mul_(scale)
        if soft_cap is not None:
            logits = logits.div_(soft_cap).tanh_().mul_(soft_cap)
        # query j of the row sits at position length - (end - start) + j and sees positions up to it
        query_pos = torch.arange(length - (end - start), length, device=q.device).repeat_interleave(group)
        future = torch.arange(length, device=q.device)[None, :] > query_pos[:, None]
        logits.masked_fill_(future[None], float("-inf"))
        mass[row, :, :length] = torch.softmax(logits, dim=-1).sum(dim=1)
    return mass
