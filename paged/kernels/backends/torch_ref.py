"""The torch backend: plain torch implementations of the ops, the reference every backend must match.

Decode attention implements both of vLLM's algorithms so `kernel=v1|v2` changes the math path, not
just a label: v1 takes one softmax over the whole context; v2 splits the context into partitions,
keeps per-partition max logit, exp-sum and normalised partial output, then rescales and reduces.
Prefill attention is one padded `scaled_dot_product_attention` over the whole batch.
"""

from __future__ import annotations

import torch

from paged.kernels.backends.base import CacheView, KernelBackend

_NEG_INF = float("-inf")
# Bounds one prefill SDPA call's padded K (V alike) and mask, in elements.
PREFILL_GROUP_ELEMENTS = 1 << 25


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
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


def _table_columns(block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The first `num_blocks` columns as int64 indices; columns past the table's end read block 0."""
    cols = block_tables.shape[1]
    blocks = block_tables[:, : min(num_blocks, cols)].long()
    if cols < num_blocks:
        blocks = torch.nn.functional.pad(blocks, (0, num_blocks - cols))
    return blocks


def _blocks(cache: CacheView, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's first `num_blocks` blocks, KV-head major so attention needs no further copy:
    K `[Hk, S, nb * bs, D]` and V `[Hk, S, nb, D, bs]`.

    K is reordered token-major (it moves x-element, 16-byte runs); V keeps its `[D, bs]` tiles
    because transposing them element by element costs more than multiplying against the
    transposed tile.
    """
    blocks = _table_columns(cache.block_tables, num_blocks)
    num_seqs = blocks.shape[0]
    k = cache.key_cache[blocks].float().permute(2, 0, 1, 4, 3, 5)
    v = cache.value_cache.permute(1, 0, 2, 3)[:, blocks].float()
    return k.reshape(cache.num_kv_heads, num_seqs, num_blocks * cache.block_size, -1), v


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


def paged_attention_v1(query: torch.Tensor, cache: CacheView, scale: float, max_seq_len: int) -> torch.Tensor:
    num_blocks = -(-max_seq_len // cache.block_size)
    k, v = _blocks(cache, num_blocks)
    probs = torch.softmax(_logits(query, k, cache.seq_lens, scale), dim=-1)
    hk, s, g, _ = probs.shape
    out = _weighted_values(probs.view(hk, s, g, 1, num_blocks, -1), v.unsqueeze(2))
    return _finish(out.squeeze(2), query)


def paged_attention_v2(
    query: torch.Tensor, cache: CacheView, scale: float, max_seq_len: int, partition_size: int
) -> torch.Tensor:
    block_size = cache.block_size
    num_partitions = -(-max_seq_len // partition_size)
    blocks_per_partition = partition_size // block_size
    k, v = _blocks(cache, num_partitions * blocks_per_partition)
    logits = _logits(query, k, cache.seq_lens, scale)
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


def _padded_context(cache: CacheView, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's K and V as `[S, Hk, max_seq_len, D]`, zero past its seq_len so that stale
    (even NaN) slots cannot leak through a masked weight of 0."""
    num_seqs, num_kv_heads = cache.block_tables.shape[0], cache.num_kv_heads
    num_blocks = -(-max_seq_len // cache.block_size)
    blocks = _table_columns(cache.block_tables, num_blocks)
    padded = num_blocks * cache.block_size
    k = cache.key_cache[blocks].permute(0, 2, 1, 4, 3, 5).reshape(num_seqs, num_kv_heads, padded, -1)
    v = cache.value_cache[blocks].permute(0, 2, 1, 4, 3).reshape(num_seqs, num_kv_heads, padded, -1)
    past_end = torch.arange(padded, device=k.device)[None, :] >= cache.seq_lens[:, None]
    past_end = past_end[:, None, :, None]
    return k.masked_fill_(past_end, 0)[:, :, :max_seq_len], v.masked_fill_(past_end, 0)[:, :, :max_seq_len]


def _attend_group(
    query: torch.Tensor, cache: CacheView, starts: torch.Tensor, q_lens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded SDPA call for a group of sequences: queries padded to `[n, H, Lq, D]`, K/V
    gathered to `Lk`, a boolean mask for causality, which lets CPU flash attention work in tiles
    instead of materialising the scores. Padding rows attend like their sequence's last token (no
    row is fully masked, so none is NaN) and are dropped. Returns (query rows, their output)."""
    device, seq_lens = query.device, cache.seq_lens.long()
    max_query_len, max_seq_len = int(q_lens.max()), int(seq_lens.max())
    num_tokens = int(q_lens.sum())
    owner = torch.repeat_interleave(torch.arange(len(q_lens), device=device), q_lens, output_size=num_tokens)
    rows = torch.arange(num_tokens, device=device) - (q_lens.cumsum(0) - q_lens)[owner]
    tokens = starts[owner] + rows
    q = query.new_zeros(len(q_lens), max_query_len, *query.shape[1:])
    q[owner, rows] = query[tokens]
    k, v = _padded_context(cache, max_seq_len)
    positions = (seq_lens - q_lens)[:, None] + torch.arange(max_query_len, device=device)[None, :]
    positions = torch.minimum(positions, seq_lens[:, None] - 1)
    mask = torch.arange(max_seq_len, device=device)[None, None, :] <= positions[:, :, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )
    return tokens, out.transpose(1, 2)[owner, rows]


def prefill_attention(
    query: torch.Tensor, cache: CacheView, query_start_loc: torch.Tensor, scale: float
) -> torch.Tensor:
    """Padded SDPA calls over groups of sequences whose contexts lie within a factor of two, so
    padding at most doubles a group's context; a group larger than `PREFILL_GROUP_ELEMENTS` of
    padded K, or of mask, is split. The calls are per length class, not per sequence."""
    starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - starts
    lens = cache.seq_lens.long()
    length_class = torch.log2(lens.clamp_min(1).double()).ceil().long()
    out = torch.empty_like(query)
    for value in length_class.unique().tolist():
        group = (length_class == value).nonzero().squeeze(1)
        group_q, group_len = int(q_lens[group].max()), int(lens[group].max())
        per_call = PREFILL_GROUP_ELEMENTS // max(group_len * cache.num_kv_heads * cache.head_size, group_q * group_len)
        for part in group.split(max(1, per_call)):
            part_cache = CacheView(cache.key_cache, cache.value_cache, cache.block_tables[part], cache.seq_lens[part])
            tokens, part_out = _attend_group(query, part_cache, starts[part], q_lens[part], scale)
            out[tokens] = part_out
    return out


class TorchBackend(KernelBackend):
    """The reference on any device, any head size and block size; `cpu`, `cuda` and `emu` subclass
    it for the ops they implement natively."""

    name = "torch"
    description = "torch reference"

    def paged_attention(
        self, query: torch.Tensor, cache: CacheView, scale: float, version: str, partition_size: int, max_seq_len: int
    ) -> torch.Tensor:
        if version == "v1":
            return paged_attention_v1(query, cache, scale, max_seq_len)
        return paged_attention_v2(query, cache, scale, max_seq_len, partition_size)

    def prefill_attention(
        self, query: torch.Tensor, cache: CacheView, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
        max_seq_len: int,
    ) -> torch.Tensor:
        return prefill_attention(query, cache, query_start_loc, scale)

    reshape_and_cache = staticmethod(reshape_and_cache)
    copy_blocks = staticmethod(copy_blocks)


BACKEND = TorchBackend()
