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
    """Each sequence's first `num_blocks` blocks, kept in the cache layout (no permuted copies):
    K `[S, nb, Hk, D/x, bs, x]`, V `[S, nb, Hk, D, bs]`. Table columns past the end read block 0."""
    cols = block_tables.shape[1]
    blocks = block_tables[:, : min(num_blocks, cols)].long()
    if cols < num_blocks:
        blocks = torch.nn.functional.pad(blocks, (0, num_blocks - cols))
    return key_cache[blocks].float(), value_cache[blocks].float()


def _logits(
    query: torch.Tensor, k: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """fp32 logits `[S, Hk, G, nb, bs]` with positions at or past each seq_len set to -inf."""
    num_seqs, num_heads, head_size = query.shape
    _, num_blocks, num_kv_heads, d_over_x, block_size, x = k.shape
    q = query.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, d_over_x, x)
    logits = torch.einsum("shgdx,snhdtx->shgnt", q, k) * scale
    pos = torch.arange(num_blocks * block_size, device=query.device).view(num_blocks, block_size)
    mask = pos[None] >= seq_lens.to(query.device).long()[:, None, None]
    return logits.masked_fill_(mask[:, None, None], _NEG_INF)


def paged_attention_v1(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
) -> torch.Tensor:
    block_size = key_cache.shape[3]
    k, v = _blocks(key_cache, value_cache, block_tables, -(-max_seq_len // block_size))
    logits = _logits(query, k, seq_lens, scale)
    s, hk, g, nb, bs = logits.shape
    probs = torch.softmax(logits.view(s, hk, g, nb * bs), dim=-1).view(s, hk, g, nb, bs)
    out = torch.einsum("shgnt,snhdt->shgd", probs, v)
    return out.reshape(query.shape).to(query.dtype)


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
    s, hk, g, _, bs = logits.shape
    parts = logits.view(s, hk, g, num_partitions, blocks_per_partition * bs)
    max_logits = parts.amax(dim=-1)  # [S, Hk, G, P]; -inf for partitions past seq_len
    safe_max = torch.where(torch.isinf(max_logits), torch.zeros_like(max_logits), max_logits)
    exp = torch.exp(parts - safe_max[..., None])
    exp_sums = exp.sum(dim=-1)
    v_parts = v.view(s, num_partitions, blocks_per_partition, hk, -1, bs)
    exp_blocks = exp.view(s, hk, g, num_partitions, blocks_per_partition, bs)
    tmp_out = torch.einsum("shgpnt,spnhdt->shgpd", exp_blocks, v_parts)
    tmp_out = tmp_out / exp_sums.clamp_min(1e-30)[..., None]
    global_max = max_logits.amax(dim=-1, keepdim=True)
    rescaled = exp_sums * torch.exp(max_logits - global_max)  # exp(-inf) = 0 for empty partitions
    weights = rescaled / rescaled.sum(dim=-1, keepdim=True)
    out = (tmp_out * weights[..., None]).sum(dim=-2)
    return out.reshape(query.shape).to(query.dtype)


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
