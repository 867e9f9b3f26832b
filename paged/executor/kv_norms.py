"""What a KV press may read of the cache (`paged.memory.press`): each held token's key and value L2
norms, averaged over a KV group's layers and the KV heads, per compressed group (`KVLayout.full_groups`;
the one group of a model without KV groups), for the sequences a step's press judges."""

from __future__ import annotations

import numpy as np
import torch

from paged.kv_layout import KVLayout
from paged.step import ScheduledSeq, SchedulerOutput


def held_kv_norms(
    sched: SchedulerOutput, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_size: int,
    layout: KVLayout,
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """seq_id -> (key norms, value norms), float32 `[compressed groups, held]`, of `sched.press_rows`
    after the step wrote their KV; a group's norms are read through its own block table from the KV
    tensors its layers use. An fp8 cache's norms are of its stored values (per-head scales not applied)."""
    norms: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    offsets = sched.kv_offsets
    for row in sched.press_rows:
        item = sched.scheduled[row]
        held = item.context_len - (offsets[row] if offsets is not None else 0)
        per_group = [_group_norms(_table(item, g), held, key_caches[: len(layout.groups[g].layers)],
                                  value_caches[: len(layout.groups[g].layers)], block_size)
                     for g in layout.full_groups]
        norms[item.seq.seq_id] = (np.stack([k for k, _ in per_group]), np.stack([v for _, v in per_group]))
    return norms


def _table(item: ScheduledSeq, group: int) -> list[int]:
    if group == 0:
        return item.block_table
    assert item.group_tables is not None
    return item.group_tables[group]


def _group_norms(table: list[int], held: int, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                 block_size: int) -> tuple[np.ndarray, np.ndarray]:
    num_blocks = -(-held // block_size)
    blocks = torch.tensor(table[:num_blocks], dtype=torch.long, device=key_caches[0].device)
    keys = torch.zeros(held, dtype=torch.float32, device=blocks.device)
    values = torch.zeros_like(keys)
    for key_cache, value_cache in zip(key_caches, value_caches, strict=True):
        k = key_cache[blocks].float().permute(0, 3, 1, 2, 4)  # [blocks, block_size, heads, d/x, x]
        v = value_cache[blocks].float().permute(0, 3, 1, 2)  # [blocks, block_size, heads, d]
        keys += k.reshape(num_blocks * block_size, k.shape[2], -1)[:held].norm(dim=-1).mean(dim=1)
        values += v.reshape(num_blocks * block_size, v.shape[2], -1)[:held].norm(dim=-1).mean(dim=1)
    return (keys / len(key_caches)).cpu().numpy(), (values / len(value_caches)).cpu().numpy()
