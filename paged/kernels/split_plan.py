"""How v3 decode splits each sequence's context: one plan per step, from host numbers only.

v3 runs one work item (a CUDA thread block, an OpenMP task) per (sequence, KV head, KV split) and
merges a sequence's splits by log-sum-exp. Splits only pay when the batch alone leaves the
hardware idle: few sequences, or few KV heads, over long contexts. The planner sizes them as
FlashInfer's decode planner does, as many work items as every processor's slots hold once, and
bounds them by bytes, not tokens: no split reads fewer than `MIN_SPLIT_BYTES` of K and V
(`kv_bytes_per_token`: head size x 2 x the cache's element size, so an fp8 or head-64 split holds
twice the tokens of a 16-bit head-128 one), below which its partial output and the pipeline's first
loads cost more than the parallelism buys. Every split is a whole number of v3's K/V tiles. So one
long sequence spreads over every SM (1x4096 at 8 KV heads: 64 splits of 64 tokens on an H200's
528 slots, where a 256-token floor left 128 work items on 132 SMs).

The plan depends only on the batch's shape and its longest context (for a CUDA graph, the longest
context it may replay), never on the lengths on the device, so a captured graph replays it: a
sequence shorter than the longest simply has empty trailing splits.
"""

from __future__ import annotations

from dataclasses import dataclass

# Tokens of one K/V tile of v3 (kernels_cu/decode_v3.cuh's TILE_TOKENS): splits hold whole tiles.
TILE_TOKENS = 32
# The most splits a sequence may have: bounds the scratch (`[seqs, heads, splits, head_size]` fp32;
# splits are planned only while the work items underfill the slots, so it stays near slots x group
# x head x 4 bytes). 256 lets one sequence of a single KV head (a TP-8 shard of a GQA-8 model) put
# 2-tile splits on half an H200's 528 slots.
MAX_SPLITS = 256
# K and V bytes of one token of one KV head at head size 128 in a 16-bit cache: the default shape.
KV_BYTES_PER_TOKEN = 2 * 128 * 2
# The fewest K and V bytes a split reads: two 16-bit head-128 tiles (64 tokens). A split also writes
# its partial output, which the merge reads back (8 heads x head 128 x 4 bytes x 2 = 8 KB), and waits
# out its first loads (~1 µs: ~8 KB of an H200 slot's share of 4,454 GB/s); at 32 KB those are half
# its reads, and a latency-bound single sequence still gains from the SMs it fills.
MIN_SPLIT_BYTES = 32 * 1024


@dataclass(frozen=True)
class Hardware:
    """What the planner fills: `processors` (SMs, CPU threads) running `slots` work items at once."""

    processors: int
    slots: int = 1

    def __post_init__(self) -> None:
        if self.processors <= 0 or self.slots <= 0:
            raise ValueError(f"hardware needs positive processors and slots, got {self.processors} x {self.slots}")


@dataclass(frozen=True)
class SplitPlan:
    """`num_splits` splits of `split_blocks` cache blocks each, counted from the block holding the
    first position a row attends to (its window's start, else 0)."""

    num_splits: int
    split_blocks: int
    block_size: int

    @property
    def split_tokens(self) -> int:
        return self.split_blocks * self.block_size


def attended_blocks(max_seq_len: int, sliding_window: int | None, block_size: int) -> int:
    """The most cache blocks one row's attention reads: the whole context, or the blocks a window of
    `sliding_window` positions touches (it may start inside a block)."""
    if sliding_window is None or sliding_window >= max_seq_len:
        return -(-max_seq_len // block_size)
    return -(-(sliding_window + block_size - 1) // block_size)


def plan_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, block_size: int, hardware: Hardware, *,
    sliding_window: int | None = None, num_splits: int | None = None, max_splits: int = MAX_SPLITS,
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN, min_split_bytes: int = MIN_SPLIT_BYTES,
) -> SplitPlan:
    """The split plan of a decode batch; `num_splits` forces the count (a benchmark sweeping it)
    and is refused past `max_splits`, the scratch's capacity."""
    if num_seqs <= 0 or num_kv_heads <= 0 or max_seq_len <= 0 or block_size <= 0:
        raise ValueError(f"a split plan needs a non-empty batch, got num_seqs={num_seqs} num_kv_heads={num_kv_heads} "
                         f"max_seq_len={max_seq_len} block_size={block_size}")
    if kv_bytes_per_token <= 0:
        raise ValueError(f"kv_bytes_per_token={kv_bytes_per_token} is not a K and V size; allowed: > 0")
    tile_blocks = max(TILE_TOKENS // block_size, 1)
    tiles = -(-attended_blocks(max_seq_len, sliding_window, block_size) // tile_blocks)
    if num_splits is not None:
        if not 1 <= num_splits <= max_splits:
            raise ValueError(f"num_splits={num_splits} is outside the scratch's capacity; allowed: 1..{max_splits}")
        wanted = num_splits
    else:
        items = num_seqs * num_kv_heads
        target = hardware.processors * hardware.slots
        tile_bytes = tile_blocks * block_size * kv_bytes_per_token
        min_tiles = max(-(-min_split_bytes // tile_bytes), 1)
        # One wave: no more work items than the slots hold at once (a second wave of short splits
        # costs as long as the first, so 1.9 waves of halves take what 1 wave of wholes does, and more).
        wanted = min(target // items, tiles // min_tiles, max_splits)
    tiles_per_split = -(-tiles // max(wanted, 1))
    return SplitPlan(-(-tiles // tiles_per_split), tiles_per_split * tile_blocks, block_size)
