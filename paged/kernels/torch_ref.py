"""Torch implementations of the attention and cache ops: the reference every backend must match.

Decode attention implements both of vLLM's algorithms so `kernel=v1|v2` changes the math path, not
just a label: v1 takes one softmax over the whole context; v2 splits the context into partitions,
keeps per-partition max logit, exp-sum and normalised partial output, then rescales and reduces.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    num_blocks, num_kv_heads, d_over_x, block_size, x = key_cache.shape
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    k = key.reshape(-1, num_kv_heads, d_over_x, x).to(key_cache.dtype)
    key_cache.permute(0, 3, 1, 2, 4)[blocks, offsets] = k
    value_cache.permute(0, 3, 1, 2)[blocks, offsets] = value.to(value_cache.dtype)


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].to(key_caches[0].device)
    dst = block_mapping[:, 1].to(key_caches[0].device)
    for cache in (*key_caches, *value_caches):
        cache[dst] = cache[src]


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `context_len` tokens as `[L, num_kv_heads, head_size]` K and V."""
    block_size = key_cache.shape[3]
    num_blocks = -(-context_len // block_size)
    blocks = block_table[:num_blocks].long()
    k = key_cache[blocks]
    k = k.permute(0, 3, 1, 2, 4).reshape(num_blocks * block_size, k.shape[1], -1)
    v = value_cache[blocks].permute(0, 3, 1, 2).reshape(num_blocks * block_size, k.shape[1], -1)
    return k[:context_len], v[:context_len]


def _blocks(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's first `num_blocks` blocks, KV-head major so attention needs no further copy:
    K `[Hk, S, nb * bs, D]` and V `[Hk, S, nb, D, bs]`. Table columns past the end read block 0.

    K is reordered token-major (it moves x-element, 16-byte runs); V keeps its `[D, bs]` tiles
    because transposing them element by element costs more than multiplying against the
    transposed tile.
    """
    cols = block_tables.shape[1]
    blocks = block_tables[:, : min(num_blocks, cols)].long()
    if cols < num_blocks:
        blocks = torch.nn.functional.pad(blocks, (0, num_blocks - cols))
    num_seqs = blocks.shape[0]
    _, num_kv_heads, _, block_size, _ = key_cache.shape
    k = key_cache[blocks].float().permute(2, 0, 1, 4, 3, 5)
    v = value_cache.permute(1, 0, 2, 3)[:, blocks].float()
    return k.reshape(num_kv_heads, num_seqs, num_blocks * block_size, -1), v


def _logits(query: torch.Tensor, k: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 logits `[Hk, S, G, L]` with positions at or past each seq_len set to -inf."""
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads, _, max_len, _ = k.shape
    q = query.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_size).transpose(0, 1)
    logits = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    mask = torch.arange(max_len, device=query.device)[None, :] >= seq_lens.to(query.device).long()[:, None]
    return logits.masked_fill_(mask[None, :, None, :], _NEG_INF)


def _weighted_values(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`sum_t weights[..., g, t] * v[t, d]` per block, summed over a block group.

    weights `[Hk, S, G, P, nbp, bs]`, v `[Hk, S, P, nbp, D, bs]` -> `[Hk, S, P, G, D]`.
    """
    per_block = torch.matmul(weights.permute(0, 1, 3, 4, 2, 5), v.transpose(-1, -2))
    return per_block.sum(dim=3)


def _finish(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """`[Hk, S, G, D]` -> `[S, H, D]` in the query dtype."""
    return out.transpose(0, 1).reshape(query.shape).to(query.dtype)


def paged_attention_v1(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
) -> torch.Tensor:
    num_blocks = -(-max_seq_len // key_cache.shape[3])
    k, v = _blocks(key_cache, value_cache, block_tables, num_blocks)
    probs = torch.softmax(_logits(query, k, seq_lens, scale), dim=-1)
    hk, s, g, _ = probs.shape
    out = _weighted_values(probs.view(hk, s, g, 1, num_blocks, -1), v.unsqueeze(2))
    return _finish(out.squeeze(2), query)


def paged_attention_v2(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    partition_size: int,
) -> torch.Tensor:
    block_size = key_cache.shape[3]
    num_partitions = -(-max_seq_len // partition_size)
    blocks_per_partition = partition_size // block_size
    k, v = _blocks(key_cache, value_cache, block_tables, num_partitions * blocks_per_partition)
    logits = _logits(query, k, seq_lens, scale)
    hk, s, g, _ = logits.shape
    parts = logits.view(hk, s, g, num_partitions, partition_size)
    max_logits = parts.amax(dim=-1)  # [Hk, S, G, P]; -inf for partitions past seq_len
    safe_max = torch.where(torch.isinf(max_logits), torch.zeros_like(max_logits), max_logits)
    exp = torch.exp(parts - safe_max[..., None])
    exp_sums = exp.sum(dim=-1)
    tmp_out = _weighted_values(
        exp.view(hk, s, g, num_partitions, blocks_per_partition, block_size),
        v.view(hk, s, num_partitions, blocks_per_partition, -1, block_size),
    ).transpose(2, 3)  # [Hk, S, G, P, D]
    tmp_out = tmp_out / exp_sums.clamp_min(1e-30)[..., None]
    global_max = max_logits.amax(dim=-1, keepdim=True)
    rescaled = exp_sums * torch.exp(max_logits - global_max)  # exp(-inf) = 0 for empty partitions
    weights = rescaled / rescaled.sum(dim=-1, keepdim=True)
    return _finish((tmp_out * weights[..., None]).sum(dim=-2), query)


class TorchBackend:
    """The reference as a `KernelBackend`; `cpu` subclasses it for its native attention."""

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        version: str,
        partition_size: int,
        max_seq_len: int,
    ) -> torch.Tensor:
        if version == "v1":
            return paged_attention_v1(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len)
        return paged_attention_v2(
            query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, partition_size
        )

    reshape_and_cache = staticmethod(reshape_and_cache)
    copy_blocks = staticmethod(copy_blocks)


BACKEND = TorchBackend()


def prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last `T` of `L` positions: q `[T, H, D]`, k/v `[L, Hk, D]`."""
    num_new, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.transpose(0, 1)
    k = key.transpose(0, 1).repeat_interleave(group, dim=0)
    v = value.transpose(0, 1).repeat_interleave(group, dim=0)
    if num_new == context_len:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(context_len - num_new, context_len, device=query.device)
        mask = q_pos[:, None] >= torch.arange(context_len, device=query.device)[None, :]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)
