"""v3 decode's launch plan (kernels_cu/decode_v3.cuh) for the runner backends: the split plan and
its scratch, made once per step, and the main and merge launches of each layer's call.

The split count comes from `paged.kernels.split_plan` with the device's SMs and the CTAs one SM
holds at v3's shared memory and thread count, and the pipeline's depth from `paged.kernels.v3_layout`
with the device and the cache's element size, so the plan depends on the batch's shape and longest
context only: a CUDA graph replays the plan it was captured with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged.kernels.backends.interface import CacheView
from paged.kernels.backends.launch_api import Arg, Launch, Ptr
from paged.kernels.features import FP8_DTYPES
from paged.kernels.split_plan import MAX_SPLITS, SplitPlan, attended_blocks, plan_splits
from paged.kernels.toolchain.specs import Unit, attention_unit, group_tile
from paged.kernels.v3_layout import V3_THREADS, DeviceLimits, check_stages, hardware, v3_shared_memory, v3_stages


@dataclass(frozen=True)
class V3Workspace:
    """A step's split plan, the depth of its K/V pipeline and, with more than one split, its fp32
    scratch: `lse` `[num_seqs, num_heads, splits]` and the partial outputs `[..., head_size]`."""

    plan: SplitPlan
    lse: torch.Tensor | None
    tmp_out: torch.Tensor | None
    stages: int

    @property
    def capacity(self) -> int:
        """The most splits the scratch holds."""
        return 1 if self.lse is None else self.lse.shape[2]


def v3_workspace(
    limits: DeviceLimits, num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
    max_seq_len: int, sliding_window: int | None, device: torch.device, num_splits: int | None = None,
    cache_element_size: int = 2, num_stages: int | None = None,
) -> V3Workspace:
    """Plans the splits of rows of up to `max_seq_len` and allocates their scratch. Splits are sized
    by the K/V bytes they read at the cache's `cache_element_size` (an fp8 split holds twice a
    16-bit one's tokens), and occupancy by the shared memory its tiles take at the pipeline's depth:
    the device's (`v3_stages`), or `num_stages` forced (a benchmark sweeping it)."""
    group = num_heads // num_kv_heads
    tile = group_tile(group)
    chunks = -(-group // tile)
    if num_stages is None:
        num_stages = v3_stages(limits, cache_element_size, head_size, tile)
    check_stages(num_stages)
    device_hw = hardware(limits, v3_shared_memory(cache_element_size, head_size, tile, num_stages))
    plan = plan_splits(num_seqs, num_kv_heads * chunks, max(max_seq_len, 1), block_size, device_hw,
                       sliding_window=sliding_window, num_splits=num_splits,
                       kv_bytes_per_token=2 * head_size * cache_element_size)
    if plan.num_splits == 1:
        return V3Workspace(plan, None, None, num_stages)
    lse = torch.empty((num_seqs, num_heads, plan.num_splits), dtype=torch.float32, device=device)
    tmp_out = torch.empty((num_seqs, num_heads, plan.num_splits, head_size), dtype=torch.float32, device=device)
    return V3Workspace(plan, lse, tmp_out, num_stages)


def check_workspace(workspace: V3Workspace, max_seq_len: int, sliding_window: int | None, block_size: int) -> None:
    """A plan must cover the rows' longest span and fit its scratch: a kernel given less would leave
    tokens out or write past the scratch."""
    plan = workspace.plan
    if plan.num_splits > min(workspace.capacity, MAX_SPLITS):
        raise ValueError(f"the split plan has {plan.num_splits} splits but the scratch holds "
                         f"{workspace.capacity}; allowed: 1..{min(workspace.capacity, MAX_SPLITS)}")
    needed = attended_blocks(max_seq_len, sliding_window, block_size)
    if plan.block_size != block_size or plan.num_splits * plan.split_blocks < needed:
        raise ValueError(f"the split plan covers {plan.num_splits} x {plan.split_blocks} blocks of "
                         f"{plan.block_size} tokens, but rows of max_seq_len={max_seq_len} need {needed} blocks of "
                         f"{block_size}: plan the step with its longest context")


def v3_unit(query: torch.Tensor, cache: CacheView, plain: bool, stages: int) -> tuple[Unit, int]:
    """The unit v3 runs for this query and cache with a `stages`-deep pipeline, and the dynamic
    shared memory of its main kernel."""
    num_heads, head_size = query.shape[1], query.shape[2]
    key_cache = cache.key_cache
    unit = attention_unit(query.dtype, head_size, cache.block_size, "v3", 0, key_cache.dtype, not plain,
                          num_heads // cache.num_kv_heads, stages)
    element = 1 if key_cache.dtype in FP8_DTYPES else key_cache.element_size()
    return unit, v3_shared_memory(element, head_size, unit.group_tile, stages)


def v3_launches(
    unit: Unit, shared_memory: int, query: torch.Tensor, out: torch.Tensor, cache: CacheView, scale: float,
    max_seq_len: int, sliding_window: int | None, feature_args: tuple[Arg, ...], workspace: V3Workspace,
) -> list[Launch]:
    """The main launch (grid: KV heads x head chunks, sequences, splits) and, with several splits,
    the merge. `cache`'s block tables and lengths must be contiguous and outlive the launches."""
    num_seqs, num_heads, _ = query.shape
    key_cache, value_cache = cache.key_cache, cache.value_cache
    block_size, num_kv_heads = cache.block_size, cache.num_kv_heads
    check_workspace(workspace, max_seq_len, sliding_window, block_size)
    plan, lse, tmp_out = workspace.plan, workspace.lse, workspace.tmp_out
    if tmp_out is not None and (tmp_out.shape[0] < num_seqs or tmp_out.shape[1] != num_heads
                                or tmp_out.shape[3] != query.shape[2]):
        # a scratch planned for fewer rows or other heads would be written past its end
        raise ValueError(f"the v3 scratch {tuple(tmp_out.shape)} was planned for other rows than the query's "
                         f"{tuple(query.shape)}; allowed: [>= {num_seqs}, {num_heads}, splits, {query.shape[2]}]")
    scratch = (Ptr(0), Ptr(0)) if lse is None or tmp_out is None else (Ptr(lse.data_ptr()), Ptr(tmp_out.data_ptr()))
    window = np.int32(sliding_window or 0)
    args = (
        Ptr(out.data_ptr()), *scratch, Ptr(query.data_ptr()), Ptr(key_cache.data_ptr()),
        Ptr(value_cache.data_ptr()), np.int32(num_heads), np.int32(num_kv_heads), np.float32(scale),
        Ptr(cache.block_tables.data_ptr()), Ptr(cache.seq_lens.data_ptr()), np.int32(cache.block_tables.shape[1]),
        np.int32(query.stride(0)), np.int32(key_cache.stride(0)), np.int32(key_cache.stride(1)), window,
        np.int32(plan.split_blocks), np.int32(workspace.capacity), *feature_args,
    )
    grid = (num_kv_heads * -(-(num_heads // num_kv_heads) // unit.group_tile), num_seqs, plan.num_splits)
    launches = [Launch(unit.kernels[0], grid, V3_THREADS, shared_memory, args)]
    if plan.num_splits > 1:
        launches.append(Launch(unit.kernels[1], (num_heads, num_seqs, 1), V3_THREADS, 0, (
            Ptr(out.data_ptr()), *scratch, Ptr(cache.seq_lens.data_ptr()), np.int32(block_size),
            np.int32(plan.split_blocks), np.int32(workspace.capacity), window)))
    return launches
