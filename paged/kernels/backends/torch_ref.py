"""The torch backend: plain torch implementations of the ops, the reference every backend must match.

Decode attention implements both of vLLM's algorithms so `kernel=v1|v2` changes the math path, not
just a label: v1 takes one softmax over the whole context; v2 splits the context into partitions,
keeps per-partition max logit, exp-sum and normalised partial output, then rescales and reduces.
Prefill attention is one padded `scaled_dot_product_attention` over the whole batch. With a
sliding window, both gather only the blocks the window reaches, as the kernels do. An fp8 cache is
dequantised as it is gathered (value * its head's scale), a cache of another float dtype than the
query's is read as fp32 (and written converted); ALiBi adds slope * (key - query position)
to the logits, block-sparse attention masks what its pattern leaves out, and a soft-cap c bounds the
scaled logits to c * tanh(s / c) (`paged.kernels.features`). Only this backend soft-caps: SDPA cannot,
so a soft-capped prefill computes its scores and softmax itself, as transformers' eager attention does.
"""

from __future__ import annotations

import numpy as np
import torch

from paged.kernels.backends.interface import CACHE_DTYPES, FEATURES, CacheView, KernelBackend, window_span
from paged.kernels.backends.torch_mass import attention_mass
from paged.kernels.backends.torch_prefill_plan import PrefillGroup, PrefillPlan, plan_prefill
from paged.kernels.features import FP8_DTYPES, NONE, AttentionFeatures, quantize

_NEG_INF = float("-inf")


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    has_padding: bool = True,
) -> None:
    if has_padding:
        # reading whether any slot is -1 would wait for the device: select the others instead
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    num_blocks, num_kv_heads, d_over_x, block_size, x = key_cache.shape
    if key_cache.dtype in FP8_DTYPES:
        key, value = quantize(key, k_scale, key_cache.dtype), quantize(value, v_scale, value_cache.dtype)
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


def swap_blocks(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Gathers the source blocks where they are and scatters them where they go; each pool is on
    one device."""
    src_ids = block_mapping[:, 0].to(src_caches[0].device)
    dst_ids = block_mapping[:, 1].to(dst_caches[0].device)
    for src, dst in zip(src_caches, dst_caches):
        dst[dst_ids] = src[src_ids].to(dst.device)


def _window_start(ends: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """The first position a query at `ends - 1` attends to."""
    if sliding_window is None:
        return torch.zeros_like(ends)
    return (ends - sliding_window).clamp_min(0)


def _live_blocks(
    cache: CacheView, first_block: torch.Tensor, num_blocks: int, live_first: torch.Tensor
) -> torch.Tensor:
    """int64 `[S, num_blocks]`: the blocks of table columns `first_block + j`, each column clamped
    into the sequence's live columns, `live_first` to its last. A column outside them may lie past
    the table's end or name a stale block (one wholly before the window, which the block manager
    freed and may have handed to another sequence), so it reads a live block, whose slots there
    the caller masks."""
    cols = first_block[:, None] + torch.arange(num_blocks, device=first_block.device)
    last = (cache.seq_lens.long() - 1).clamp_min(0) // cache.block_size
    cols = torch.minimum(cols, last[:, None]).maximum(live_first[:, None])
    return cache.block_tables.gather(1, cols).long()


def _blocks(
    cache: CacheView, first: torch.Tensor, num_blocks: int, window_start: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sequence's `num_blocks` blocks from its position `first` (a block boundary), KV-head
    major so attention needs no further copy: K `[Hk, S, nb * bs, D]`, V `[Hk, S, nb, D, bs]`, and
    which of their slots `[S, nb * bs]` hold a position in `[window_start, seq_len)`. V is zero in
    the other slots so that stale (even NaN) values cannot leak through a weight of 0.

    K is reordered token-major (it moves x-element, 16-byte runs); V keeps its `[D, bs]` tiles
    because transposing them element by element costs more than multiplying against the
    transposed tile.
    """
    bs, seq_lens = cache.block_size, cache.seq_lens.long()
    blocks = _live_blocks(cache, first // bs, num_blocks, window_start // bs)
    num_seqs = blocks.shape[0]
    positions = first[:, None] + torch.arange(num_blocks * bs, device=first.device)
    valid = (positions >= window_start[:, None]) & (positions < seq_lens[:, None])
    k = cache.key_cache[blocks].float().permute(2, 0, 1, 4, 3, 5)
    v = cache.value_cache.permute(1, 0, 2, 3)[:, blocks].float()
    if cache.fp8:
        k = k * cache.k_scale.view(-1, 1, 1, 1, 1, 1)
        v = v * cache.v_scale.view(-1, 1, 1, 1, 1)
    v.masked_fill_(~valid.view(num_seqs, num_blocks, 1, bs), 0)
    return k.reshape(cache.num_kv_heads, num_seqs, num_blocks * bs, -1), v, valid


def _logits(
    query: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, scale: float, positions: torch.Tensor,
    seq_lens: torch.Tensor, features: AttentionFeatures,
) -> torch.Tensor:
    """fp32 logits `[Hk, S, G, L]` of the decode query (at `seq_lens - 1`) against the slots at
    `positions` `[S, L]`, with the features applied; -inf where a slot is not `valid` or the
    block-sparse pattern leaves it out."""
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    q = query.float().view(num_seqs, num_kv_heads, group, head_size).transpose(0, 1)
    logits = _soft_capped(torch.matmul(q, k.transpose(-1, -2)).mul_(scale), features.soft_cap)
    query_pos = (seq_lens.long() - 1)[:, None]  # [S, 1]
    if features.alibi_slopes is not None:
        slopes = features.alibi_slopes.view(num_kv_heads, 1, group, 1)
        logits += slopes * (positions - query_pos)[None, :, None, :]
    masked = ~valid[None, :, None, :]
    if features.blocksparse is not None:
        offsets = features.blocksparse.offsets(num_heads, num_kv_heads, query.device).view(num_kv_heads, 1, group, 1)
        masked = masked | ~features.blocksparse.allowed(query_pos[None, :, None, :], positions[None, :, None, :],
                                                        offsets)
    return logits.masked_fill_(masked, _NEG_INF)


def _soft_capped(logits: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    """Gemma-2's cap on scaled logits, `c * tanh(s / c)`, in place; unchanged without one."""
    if soft_cap is None:
        return logits
    return logits.div_(soft_cap).tanh_().mul_(soft_cap)


def _weighted_values(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`sum_t weights[..., g, t] * v[t, d]` per block, summed over a block group.

    weights `[Hk, S, G, P, nbp, bs]`, v `[Hk, S, P, nbp, D, bs]` -> `[Hk, S, P, G, D]`.
    """
    per_block = torch.matmul(weights.permute(0, 1, 3, 4, 2, 5), v.transpose(-1, -2))
    return per_block.sum(dim=3)


def _finish(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """`[Hk, S, G, D]` -> `[S, H, D]` in the query dtype."""
    return out.transpose(0, 1).reshape(query.shape).to(query.dtype)


def _window(cache: CacheView, sliding_window: int | None, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's window start, and that start rounded down to a multiple of `align`, where
    gathering begins."""
    window_start = _window_start(cache.seq_lens.long(), sliding_window)
    return window_start, window_start // align * align


def _positions(first: torch.Tensor, length: int) -> torch.Tensor:
    """`[S, length]` context positions from each sequence's `first`."""
    return first[:, None] + torch.arange(length, device=first.device)


def paged_attention_v1(
    query: torch.Tensor, cache: CacheView, scale: float, max_seq_len: int, sliding_window: int | None = None,
    features: AttentionFeatures = NONE,
) -> torch.Tensor:
    window_start, first = _window(cache, sliding_window, cache.block_size)
    num_blocks = -(-window_span(max_seq_len, sliding_window, cache.block_size) // cache.block_size)
    k, v, valid = _blocks(cache, first, num_blocks, window_start)
    positions = _positions(first, num_blocks * cache.block_size)
    probs = torch.softmax(_logits(query, k, valid, scale, positions, cache.seq_lens, features), dim=-1)
    hk, s, g, _ = probs.shape
    out = _weighted_values(probs.view(hk, s, g, 1, num_blocks, -1), v.unsqueeze(2))
    return _finish(out.squeeze(2), query)


def paged_attention_v2(
    query: torch.Tensor, cache: CacheView, scale: float, max_seq_len: int, partition_size: int,
    sliding_window: int | None = None, features: AttentionFeatures = NONE,
) -> torch.Tensor:
    """Partitions are whole `partition_size` spans of positions, as in the kernels; with a window,
    those wholly before it are not computed."""
    block_size = cache.block_size
    window_start, first = _window(cache, sliding_window, partition_size)
    num_partitions = -(-window_span(max_seq_len, sliding_window, partition_size) // partition_size)
    blocks_per_partition = partition_size // block_size
    k, v, valid = _blocks(cache, first, num_partitions * blocks_per_partition, window_start)
    positions = _positions(first, num_partitions * partition_size)
    logits = _logits(query, k, valid, scale, positions, cache.seq_lens, features)
    hk, s, g, _ = logits.shape
    parts = logits.view(hk, s, g, num_partitions, partition_size)
    max_logits = parts.amax(dim=-1)  # [Hk, S, G, P]; -inf for partitions outside the context
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


def _padded_context(cache: CacheView, group: PrefillGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's K and V from the group's first gathered block as `[n, Hk, num_blocks * bs, D]`,
    zero outside `[window start, seq_len)` so that stale (even NaN) slots cannot leak through a
    masked weight of 0."""
    blocks = group.blocks
    num_seqs, padded = blocks.shape[0], blocks.shape[1] * cache.block_size
    k = cache.key_cache[blocks].permute(0, 2, 1, 4, 3, 5).reshape(num_seqs, cache.num_kv_heads, padded, -1)
    v = cache.value_cache[blocks].permute(0, 2, 1, 4, 3).reshape(num_seqs, cache.num_kv_heads, padded, -1)
    if cache.fp8:
        k = k.float() * cache.k_scale.view(1, -1, 1, 1)
        v = v.float() * cache.v_scale.view(1, -1, 1, 1)
    return k.masked_fill_(group.outside, 0), v.masked_fill_(group.outside, 0)


def _attend_group(
    query: torch.Tensor, cache: CacheView, group: PrefillGroup, scale: float, features: AttentionFeatures,
) -> torch.Tensor:
    """One padded SDPA call: queries padded to `[n, H, Lq, D]`, K/V gathered, a boolean mask, which
    lets CPU flash attention work in tiles instead of materialising the scores. Returns the
    output of the group's query rows."""
    num_seqs, max_query_len, max_span = group.mask.shape[0], group.mask.shape[2], group.mask.shape[3]
    q = query.new_zeros(num_seqs, max_query_len, *query.shape[1:])
    q[group.owner, group.rows] = query[group.tokens]
    k, v = _padded_context(cache, group)
    mask, positions, key_positions = group.mask, group.positions, group.key_positions
    num_heads, num_kv_heads = query.shape[1], cache.num_kv_heads
    if features.blocksparse is not None:
        offsets = features.blocksparse.offsets(num_heads, num_kv_heads, query.device).view(1, -1, 1, 1)
        mask = mask & features.blocksparse.allowed(positions[:, None], key_positions[:, None], offsets)
        # slots no query of a KV head sees stand for blocks the kernels never read: zero, so that
        # whatever they hold cannot leak through a weight of 0
        unseen = ~mask.view(num_seqs, num_kv_heads, -1, max_span).any(dim=2)[..., None]  # [n, Hk, Lk, 1]
        k, v = k[:, :, :max_span].masked_fill(unseen, 0), v[:, :, :max_span].masked_fill(unseen, 0)
    if features.alibi_slopes is not None:
        bias = features.alibi_slopes.view(1, -1, 1, 1) * (key_positions - positions)[:, None].float()
        mask = bias.masked_fill_(~mask, _NEG_INF)
    if cache.fp8 or k.dtype != q.dtype or features.alibi_slopes is not None or features.soft_cap is not None:
        # fp32 throughout: the dequantised (or other-dtype) cache is read as fp32, and a float mask must
        # match the query's dtype
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = q.transpose(1, 2), k[:, :, :max_span], v[:, :, :max_span]
    if features.soft_cap is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        out = _soft_capped_attention(q, k, v, mask, scale, features.soft_cap)
    return out.transpose(1, 2)[group.owner, group.rows].to(query.dtype)


def _soft_capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, soft_cap: float
) -> torch.Tensor:
    """SDPA's math with the cap between the scaling and the mask: q `[n, H, Lq, D]`, k and v
    `[n, Hk, Lk, D]`, `mask` bool (True: attend) or an additive float bias `[n, 1 or H, Lq, Lk]`."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = _soft_capped(torch.matmul(q, k.transpose(-1, -2)).mul_(scale), soft_cap)
    logits = logits.masked_fill_(~mask, _NEG_INF) if mask.dtype == torch.bool else logits.add_(mask)
    return torch.matmul(torch.softmax(logits, dim=-1), v)


def prefill_attention(
    query: torch.Tensor, cache: CacheView, query_start_loc: torch.Tensor, scale: float,
    sliding_window: int | None = None, features: AttentionFeatures = NONE, plan: PrefillPlan | None = None,
) -> torch.Tensor:
    """Padded SDPA calls per length class of `plan` (not per sequence); without one it is made from
    host copies of the metadata, which on an accelerator waits for the device."""
    if plan is None:
        plan = plan_prefill(query_start_loc.cpu().numpy(), cache.seq_lens.cpu().numpy(),
                            cache.block_tables.cpu().numpy(), cache.block_size, cache.num_kv_heads, cache.head_size,
                            sliding_window, query.device)
    out = torch.empty_like(query)
    for group in plan.groups:
        out[group.tokens] = _attend_group(query, cache, group, scale, features)
    return out


class TorchBackend(KernelBackend):
    """The reference on any device, any head size and block size; `cpu`, `cuda` and `emu` subclass
    it for the ops they implement natively."""

    name = "torch"
    description = "torch reference"
    cache_dtypes = CACHE_DTYPES
    converts_cache_dtype = True
    features = FEATURES

    def unsupported_reason(
        self, device: torch.device, dtype: torch.dtype, head_size: int | None, block_size: int | None,
        partition_size: int | None = None, cache_dtype: torch.dtype | None = None,
        features: AttentionFeatures = NONE,
    ) -> str | None:
        if cache_dtype in FP8_DTYPES and device.type == "mps":
            return f"kv cache dtype={cache_dtype} needs float8 tensors, which torch does not implement on mps"
        return super().unsupported_reason(device, dtype, head_size, block_size, partition_size, cache_dtype, features)

    def paged_attention(
        self, query: torch.Tensor, cache: CacheView, scale: float, version: str, partition_size: int, max_seq_len: int,
        sliding_window: int | None, features: AttentionFeatures = NONE, workspace: object = None,
    ) -> torch.Tensor:
        # v3's single pass computes v1's softmax; its splits are a schedule, not different math
        if version in ("v1", "v3"):
            return paged_attention_v1(query, cache, scale, max_seq_len, sliding_window, features)
        return paged_attention_v2(query, cache, scale, max_seq_len, partition_size, sliding_window, features)

    def plan_prefill(
        self, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
        num_kv_heads: int, head_size: int, sliding_window: int | None, device: torch.device,
    ) -> PrefillPlan:
        return plan_prefill(query_start_loc, seq_lens, block_tables, block_size, num_kv_heads, head_size,
                            sliding_window, device)

    def prefill_attention(
        self, query: torch.Tensor, cache: CacheView, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
        max_seq_len: int, sliding_window: int | None, features: AttentionFeatures = NONE, plan: object = None,
    ) -> torch.Tensor:
        assert plan is None or isinstance(plan, PrefillPlan)
        return prefill_attention(query, cache, query_start_loc, scale, sliding_window, features, plan)

    reshape_and_cache = staticmethod(reshape_and_cache)
    copy_blocks = staticmethod(copy_blocks)
    attention_mass = staticmethod(attention_mass)
    swap_blocks = staticmethod(swap_blocks)


BACKEND = TorchBackend()
