"""A decode step's attention as one native call of all of a model's layers runs it (`paged.model.decode_layers`).

On the cpu backend a step whose rows all decode, over one KV group whose layer l writes and reads KV
tensor l, with no feature (window, ALiBi, soft-cap, block-sparse, fp8 scales, scores), runs every
layer's cache write and v3 attention with the same arguments: the step's slots, block tables,
context lengths and split plan. The executor's planned attention (`PagedAttention.stack_attention`)
hands them over in this form; a model that runs its layers natively passes them on as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StackAttention:
    """Every layer's cache write (`slot_mapping`, int64, into `num_slots` slots) and v3 decode
    attention (`block_tables` int32 `[rows, blocks]`, `seq_lens` int32 `[rows]`, `scale`, the split
    plan's `num_splits` of `split_blocks` blocks, `max_seq_len`), layer l over `key_caches[l]` and
    `value_caches[l]` (contiguous, all of one dtype: a model runs them natively only where it is its
    activations', since a cache of another dtype is converted on its write)."""

    key_caches: Sequence[torch.Tensor]
    value_caches: Sequence[torch.Tensor]
    slot_mapping: torch.Tensor
    num_slots: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    num_splits: int
    split_blocks: int
    max_seq_len: int

    @property
    def block_size(self) -> int:
        return self.value_caches[0].shape[-1]
