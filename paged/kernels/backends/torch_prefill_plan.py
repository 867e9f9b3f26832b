"""The torch backend's prefill plan: which sequences share one padded attention call, and their
gathered blocks and masks.

They depend on the step's rows, not on the layer, so a step builds them once from the host copies
of its metadata (nothing here waits on the device) and every layer's call reuses them; apart from
`torch_ref` so that the reference ops stay readable on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged.kernels.transfer import to_device

# Bounds one prefill SDPA call's padded K (V alike) and mask, in elements.
PREFILL_GROUP_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class PrefillGroup:
    """One padded SDPA call of a prefill: its sequences' query rows, the cache blocks it gathers and
    the causal (and window) mask. They depend on the batch, not the layer, so a step builds them
    once from the host copies of its metadata and every layer reuses them."""

    tokens: torch.Tensor  # int64 [num_tokens] the group's query rows in the batch
    owner: torch.Tensor  # int64 [num_tokens] each row's sequence within the group
    rows: torch.Tensor  # int64 [num_tokens] each row's place among its sequence's queries
    blocks: torch.Tensor  # int64 [n, num_blocks] blocks gathered, from the one holding the window start
    outside: torch.Tensor  # bool [n, 1, num_blocks * bs, 1] gathered slots outside [window start, seq_len)
    positions: torch.Tensor  # int64 [n, max_query_len, 1] each padded query row's position
    key_positions: torch.Tensor  # int64 [n, 1, max_span]
    mask: torch.Tensor  # bool [n, 1, max_query_len, max_span]: causality and the window


@dataclass(frozen=True)
class PrefillPlan:
    """A prefill's SDPA calls, over groups of sequences whose gathered spans (their contexts, or
    less with a window) lie within a factor of two, so padding at most doubles a group's span; a
    group larger than `PREFILL_GROUP_ELEMENTS` of padded K, or of mask, is split."""

    groups: list[PrefillGroup]


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(np.ascontiguousarray(array), device)


def _group(
    part: np.ndarray, starts: np.ndarray, q_lens: np.ndarray, lens: np.ndarray, window_start: np.ndarray,
    block_tables: np.ndarray, block_size: int, sliding_window: int | None, device: torch.device,
) -> PrefillGroup:
    """Padding rows attend like their sequence's last token (no row is fully masked, so none is
    NaN) and are dropped."""
    q, lens, window_start = q_lens[part], lens[part], window_start[part]
    owner = np.repeat(np.arange(len(part)), q)
    rows = np.arange(int(q.sum())) - (np.cumsum(q) - q)[owner]
    first_block = window_start // block_size
    max_query_len, max_span = int(q.max()), int((lens - first_block * block_size).max())
    num_blocks = -(-max_span // block_size)
    # table columns from the window's first block, clamped into the sequence's live columns (one
    # outside them may lie past the table's end or name a block freed with the window's tail)
    cols = first_block[:, None] + np.arange(num_blocks)
    cols = np.maximum(np.minimum(cols, (np.maximum(lens, 1) - 1)[:, None] // block_size), first_block[:, None])
    slots = (first_block * block_size)[:, None] + np.arange(num_blocks * block_size)
    outside = (slots < window_start[:, None]) | (slots >= lens[:, None])
    positions = np.minimum((lens - q)[:, None] + np.arange(max_query_len), (lens - 1)[:, None])[:, :, None]
    key_positions = (first_block * block_size)[:, None, None] + np.arange(max_span)
    positions_t, key_positions_t = _to(positions, device), _to(key_positions, device)
    mask = key_positions_t <= positions_t
    if sliding_window is not None:
        mask &= key_positions_t > positions_t - sliding_window
    return PrefillGroup(
        tokens=_to(starts[part][owner] + rows, device), owner=_to(owner, device), rows=_to(rows, device),
        blocks=_to(block_tables[part[:, None], cols].astype(np.int64), device),
        outside=_to(outside, device)[:, None, :, None], positions=positions_t, key_positions=key_positions_t,
        mask=mask[:, None],
    )


def plan_prefill(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
    num_kv_heads: int, head_size: int, sliding_window: int | None, device: torch.device,
) -> PrefillPlan:
    """The groups of a prefill from the host copies of its metadata: nothing here waits on the device."""
    qsl, lens = query_start_loc.astype(np.int64), seq_lens.astype(np.int64)
    starts, q_lens = qsl[:-1], np.diff(qsl)
    # of each sequence's first query
    window_start = np.zeros_like(lens) if sliding_window is None else np.maximum(lens - q_lens + 1 - sliding_window, 0)
    spans = lens - window_start // block_size * block_size
    length_class = np.ceil(np.log2(np.maximum(spans, 1))).astype(np.int64)
    groups = []
    # a sequence without query rows (a CUDA graph's padding row) has nothing to attend
    asking = q_lens > 0
    for value in np.unique(length_class[asking]):
        group = np.flatnonzero((length_class == value) & asking)
        group_q, span = int(q_lens[group].max()), int(spans[group].max())
        per_call = max(1, PREFILL_GROUP_ELEMENTS // max(span * num_kv_heads * head_size, group_q * span))
        for first in range(0, len(group), per_call):
            groups.append(_group(group[first : first + per_call], starts, q_lens, lens, window_start, block_tables,
                                 block_size, sliding_window, device))
    return PrefillPlan(groups)
