"""The real executor's KV tensors: vLLM's layout, one key and one value tensor per KV slot.

With one KV group a slot is a layer. With groups per layer type (`paged.kv_layout`) a block of the
shared pool holds `num_slots` layers, one of each group's, so the executor allocates `num_slots`
tensors of `num_blocks` blocks each and a pool block id names the same block of every tensor: block
copies and swaps apply to all of them, whatever group the block is in.
"""

from __future__ import annotations

import torch

from paged.executor.base import KVCacheSpec
from paged.kv_layout import KVLayout
from paged.model.arch import LlamaArch

KVTensors = tuple[list[torch.Tensor], list[torch.Tensor]]


def kv_block_spec(shard: LlamaArch, layout: KVLayout, num_devices: int, block_size: int,
                  cache_dtype: torch.dtype) -> KVCacheSpec:
    """A block's bytes over all ranks: each holds its KV heads' share of `layout.num_slots` layers (a
    replicated KV head counts on every rank holding it)."""
    a = shard
    ranks = f" on each of {num_devices} ranks" if num_devices > 1 else ""
    groups = f" ({layout.num_groups} KV groups, {layout.num_slots} layers a block)" if layout.is_hybrid else ""
    return KVCacheSpec(
        block_size,
        num_devices * 2 * layout.num_slots * block_size * a.num_kv_heads * a.head_dim * cache_dtype.itemsize,
        f"vLLM's per layer{groups}{ranks}: key [blocks, {a.num_kv_heads}, {a.head_dim}/x, {block_size}, x], "
        f"value [blocks, {a.num_kv_heads}, {a.head_dim}, {block_size}], {cache_dtype}",
    )


def allocate_kv(shard: LlamaArch, num_slots: int, num_blocks: int, num_cpu_blocks: int, block_size: int,
                cache_dtype: torch.dtype, device: torch.device) -> tuple[KVTensors, KVTensors]:
    """(device keys, values), (host keys, values): the device cache zeroed, so padding slots a kernel
    may read hold no NaNs; the swap space left uninitialised (a host block is only ever read after a
    whole device block was swapped into it) and pinned for a CUDA model, so swaps are DMA copies."""
    a = shard
    x = 16 // cache_dtype.itemsize
    if a.head_dim % x:
        raise ValueError(f"head_dim={a.head_dim} is not a multiple of the key cache's x={x}")

    def shapes(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (n, a.num_kv_heads, a.head_dim // x, block_size, x), (n, a.num_kv_heads, a.head_dim, block_size)

    key_shape, value_shape = shapes(num_blocks)
    kw = {"dtype": cache_dtype, "device": device}
    on_device = ([torch.zeros(key_shape, **kw) for _ in range(num_slots)],
                 [torch.zeros(value_shape, **kw) for _ in range(num_slots)])
    cpu_key_shape, cpu_value_shape = shapes(num_cpu_blocks)
    cpu_kw = {"dtype": cache_dtype, "device": "cpu", "pin_memory": device.type == "cuda"}
    on_host = ([torch.empty(cpu_key_shape, **cpu_kw) for _ in range(num_slots)],
               [torch.empty(cpu_value_shape, **cpu_kw) for _ in range(num_slots)])
    return on_device, on_host
