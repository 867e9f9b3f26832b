"""Token-slot copies in torch, for every backend that has no kernel of its own for them yet.

A slot is `block * block_size + offset`; the key cache is `[num_blocks, kv_heads, head_size/x,
block_size, x]`, the value cache `[num_blocks, kv_heads, head_size, block_size]`. Every source is
gathered before any destination is written, so a destination may be another pair's source.
"""

from __future__ import annotations

import torch


def copy_slots(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
    """For every `(src, dst)` row of `slot_mapping`, copy slot src's K and V to slot dst in every layer."""
    if slot_mapping.numel() == 0:
        return
    mapping = slot_mapping.to(key_caches[0].device)
    block_size = key_caches[0].shape[3]
    src_blocks, src_offsets = mapping[:, 0] // block_size, mapping[:, 0] % block_size
    dst_blocks, dst_offsets = mapping[:, 1] // block_size, mapping[:, 1] % block_size
    for key_cache in key_caches:
        tokens = key_cache.permute(0, 3, 1, 2, 4)  # a view: [num_blocks, block_size, heads, d/x, x]
        tokens[dst_blocks, dst_offsets] = tokens[src_blocks, src_offsets]
    for value_cache in value_caches:
        tokens = value_cache.permute(0, 3, 1, 2)  # a view: [num_blocks, block_size, heads, d]
        tokens[dst_blocks, dst_offsets] = tokens[src_blocks, src_offsets]
