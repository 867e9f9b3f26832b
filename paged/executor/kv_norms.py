"""What a KV press may read of the cache (`paged.memory.press`): each held token's key and value L2
norms, averaged over layers and KV heads, for the sequences a step's press judges."""

from __future__ import annotations

import numpy as np
import torch

from paged.step import SchedulerOutput


def held_kv_norms(
    sched: SchedulerOutput, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_size: int
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """seq_id -> (key norms, value norms), float32 `[held]`, of `sched.press_rows` after the step
    wrote their KV. An fp8 cache's norms are of its stored values (per-head scales not applied)."""
    norms: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    offsets = sched.kv_offsets
    for row in sched.press_rows:
        item = sched.scheduled[row]
        held = item.context_len - (offsets[row] if offsets is not None else 0)
        num_blocks = -(-held // block_size)
        blocks = torch.tensor(item.block_table[:num_blocks], dtype=torch.long, device=key_caches[0].device)
        keys = torch.zeros(held, dtype=torch.float32, device=blocks.device)
        values = torch.zeros_like(keys)
        for key_cache, value_cache in zip(key_caches, value_caches, strict=True):
            k = key_cache[blocks].float().permute(0, 3, 1, 2, 4)  # [blocks, block_size, heads, d/x, x]
            v = value_cache[blocks].float().permute(0, 3, 1, 2)  # [blocks, block_size, heads, d]
            keys += k.reshape(num_blocks * block_size, k.shape[2], -1)[:held].norm(dim=-1).mean(dim=1)
            values += v.reshape(num_blocks * block_size, v.shape[2], -1)[:held].norm(dim=-1).mean(dim=1)
        norms[item.seq.seq_id] = ((keys / len(key_caches)).cpu().numpy(), (values / len(value_caches)).cpu().numpy())
    return norms
