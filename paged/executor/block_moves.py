"""A rank step's block moves before its forward: swaps out, KV compaction, swaps in, then the
copy-on-write copies, on this rank's caches."""

from __future__ import annotations

import time

import torch

from paged import kernels
from paged.executor.tp_workers import RankStep
from paged.kernels.backends.interface import KernelBackend


def move_blocks(step: RankStep, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                cpu_key_caches: list[torch.Tensor], cpu_value_caches: list[torch.Tensor],
                backend: KernelBackend) -> float:
    """Out before in, so a swap-in may land in a device block that a swap-out just vacated; KV
    compaction between them, its sources read before anything writes a block they left; the copies
    last. Returns the seconds the compaction took."""
    device, host = [*key_caches, *value_caches], [*cpu_key_caches, *cpu_value_caches]
    if step.blocks_to_swap_out:
        kernels.swap_blocks(device, host, step.blocks_to_swap_out, backend=backend)
    compaction_s = 0.0
    if step.slots_to_compact is not None:
        start = time.perf_counter()
        kernels.copy_slots(key_caches, value_caches, torch.from_numpy(step.slots_to_compact), backend=backend)
        compaction_s = time.perf_counter() - start
    if step.blocks_to_swap_in:
        kernels.swap_blocks(host, device, step.blocks_to_swap_in, backend=backend)
    if step.blocks_to_copy:
        kernels.copy_blocks(key_caches, value_caches, step.blocks_to_copy, backend=backend)
    return compaction_s
