"""What one layer's decode attention costs on a simulated GPU, per kernel variant, before efficiency.

`decode_bytes` is the work of a decode batch in bytes of memory traffic, which the cost model divides
by `memory_bandwidth x efficiency` (the efficiency from `kernel_table.py`, by variant and shape
class). Each variant's kernel reads every context token's K and V from the cache, so all share the
traffic term; they differ in their work units and in what merging partial results costs:

- v1: one thread block per (sequence, query head) streams the whole context;
- v2: one per (sequence, query head, `partition_size` tokens), then a reduce kernel reads every
  partition's max, sum and partial output (fp32) and writes the row;
- v3: one per (sequence, KV head, split), the splits sized by `paged.kernels.split_plan` as the
  kernel's planner sizes them (splits only where the batch leaves SMs idle); a sequence's splits
  are merged by log-sum-exp in the same pass, which reads the same partials as v2's reduce but
  launches no second kernel.

A step also cannot end before its largest work unit streams at one SM's share of the bandwidth:
with few, long sequences v1 leaves SMs idle and v2 or v3 split the context, as vLLM's heuristic
assumes. That floor is written here as bytes too (the unit's bytes times the SM count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paged.kernels.split_plan import Hardware as SplitHardware
from paged.kernels.split_plan import plan_splits

# Reduce and merge kernels keep a partial row's max and sum (2 floats) and its output (head_dim floats).
_PARTIAL_FLOAT_BYTES = 4


@dataclass(frozen=True)
class AttentionShape:
    """One GPU's share of a layer's attention: heads, head size and the bytes of an activation and
    of a KV-cache element; the cache's block size and v2's partition size."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    kv_bytes: int
    block_size: int
    partition_size: int


def _units(variant: str, contexts: Sequence[int], shape: AttentionShape, num_sms: int) -> tuple[int, int]:
    """Context tokens of the variant's largest work unit, and the partial rows per query head it
    writes and merges: v2 one per partition, v3 one per split where a sequence has several, v1 none."""
    longest = max(contexts)
    unit, divisor = unit_split(variant, len(contexts), longest, shape, num_sms)
    return unit, sum(-(-c // divisor) for c in contexts) if divisor else 0


def unit_split(variant: str, num: int, longest: int, shape: AttentionShape, num_sms: int) -> tuple[int, int]:
    """The variant's largest unit's tokens, and the tokens a context is cut into partial rows by
    (each context gives ceil(context / it)); 0 where nothing is merged."""
    if variant == "v1":
        return longest, 0
    if variant == "v2":
        p = shape.partition_size
        return min(longest, p), p
    plan = plan_splits(num, shape.kv_heads, longest, shape.block_size, SplitHardware(num_sms))
    split = plan.split_tokens
    return min(longest, split), split if plan.num_splits > 1 else 0


def decode_bytes(variant: str, contexts: Sequence[int], read_tokens: float, shape: AttentionShape,
                 num_sms: int) -> float:
    """The batch's decode-attention work in bytes: the larger of its traffic (K/V of `read_tokens`
    context tokens at the cache's element size, queries in and outputs out at the model's) and the
    largest unit's floor, plus the merge's partials. `contexts` are the rows' context lengths."""
    unit, partials = _units(variant, contexts, shape, num_sms)
    return decode_work(len(contexts), unit, partials, read_tokens, shape, num_sms)


def decode_work(num: int, unit: int, partials: int, read_tokens: float, shape: AttentionShape, num_sms: int) -> float:
    """`decode_bytes` of `num` rows from its largest unit's tokens and the partial rows per query
    head (`unit_split`'s, fast-forward's steps keep them incrementally)."""
    d, b = shape.head_dim, shape.dtype_bytes
    traffic = 2 * read_tokens * shape.kv_heads * d * shape.kv_bytes + 2 * num * shape.heads * d * b
    work = max(traffic, 2 * unit * d * shape.kv_bytes * num_sms)
    if partials:
        work += shape.heads * (partials * (2 + d) * _PARTIAL_FLOAT_BYTES + num * d * b)
    return work
