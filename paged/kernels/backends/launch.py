"""Launch plans shared by the cuda and emu backends: grids, shared memory, scratch tensors and the
argument lists of the kernels in kernels_cu/, and the block copies of a swap. Backends differ only
in how they run a `Launch` or a `Copy`, so the emulator tests these plans too.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import NamedTuple

import numpy as np
import torch

from paged.kernels.backends.interface import (
    CACHE_DTYPES,
    KERNEL_FEATURES,
    CacheView,
    device_side,
    require_contiguous,
    window_span,
)
from paged.kernels.backends.launch_api import VECTOR_BYTES, Arg, Launch, Ptr, Runner
from paged.kernels.backends.layer_plans import FusedLayerOpsMixin
from paged.kernels.backends.mass_plan import run_attention_mass, unsupported
from paged.kernels.backends.prefill_plans import PREFILL_WARPS, prefill_shared_memory, prefill_tiles
from paged.kernels.backends.swap_plan import copy_plan, require_pinned
from paged.kernels.backends.torch_ref import TorchBackend
from paged.kernels.backends.v3_plans import V3Workspace, v3_launches, v3_unit, v3_workspace
from paged.kernels.features import NONE, AttentionFeatures
from paged.kernels.limits import BLOCK_SIZES, NATIVE_HEAD_SIZES, NATIVE_PARTITION_SIZES
from paged.kernels.toolchain.specs import NUM_THREADS, Unit, attention_unit, cache_unit, prefill_unit
from paged.kernels.transfer import to_device
from paged.kernels.v3_layout import DeviceLimits

WARP_SIZE = 32
MAX_CACHE_THREADS = 512
MAX_COPY_THREADS = 1024


class V2Scratch(NamedTuple):
    """v2's fp32 intermediates: `[num_seqs, num_heads, num_partitions]` exp sums and max logits,
    `[..., head_size]` partition outputs."""

    exp_sums: torch.Tensor
    max_logits: torch.Tensor
    tmp_out: torch.Tensor


def _ptr(t: torch.Tensor) -> Ptr:
    return Ptr(t.data_ptr())


def _aligned(t: torch.Tensor, row_stride: int) -> bool:
    return t.data_ptr() % VECTOR_BYTES == 0 and row_stride * t.element_size() % VECTOR_BYTES == 0


def _rows(t: torch.Tensor, *, vectors: bool) -> torch.Tensor:
    """`t` `[tokens, heads, dim]` as the kernels index it, `row * stride(0) + head * dim + d`: as it is
    when its layout allows (the model passes slices of a fused QKV projection), else a packed copy.
    `vectors`: the kernel reads rows in 16-byte vectors, so rows must start 16-byte aligned."""
    rows_ok = t.stride(2) == 1 and t.stride(1) == t.shape[2]
    if rows_ok and (not vectors or _aligned(t, t.stride(0))):
        return t
    # A fresh allocation is packed and aligned to far more than 16 bytes.
    return t.clone(memory_format=torch.contiguous_format)


def _require_in_place_layout(**caches: torch.Tensor) -> None:
    """Caches are read and written where they are, so they cannot be copied into shape."""
    require_contiguous(**caches)
    for name, cache in caches.items():
        if cache.data_ptr() % VECTOR_BYTES:
            raise ValueError(f"{name} starts at address {cache.data_ptr():#x}, which is not {VECTOR_BYTES}-byte "
                             f"aligned; native kernels load it in {VECTOR_BYTES}-byte vectors")


def _optional_ptr(t: torch.Tensor | None) -> Ptr:
    return Ptr(0) if t is None else _ptr(t)


def _feature_args(cache: CacheView, features: AttentionFeatures) -> tuple[Arg, ...]:
    """The kernels' FEATURE_PARAMS: fp8 scales, ALiBi slopes (null: none), block-sparse ints
    (vert_stride 0: dense)."""
    sparse = features.blocksparse
    ints = (0, 0, 0, 0) if sparse is None else (
        sparse.block_size, sparse.local_blocks, sparse.vert_stride, sparse.head_sliding_step)
    return (_optional_ptr(cache.k_scale), _optional_ptr(cache.v_scale), _optional_ptr(features.alibi_slopes),
            *map(np.int32, ints))


def _check_shared_memory(runner: Runner, unit: Unit, kernel: str, needed: int, what: str,
                         remedy: str = "use version='v2' for long contexts") -> None:
    limit = runner.dynamic_shared_memory_limit(unit, kernel)
    if needed > limit:
        raise ValueError(f"{what} needs {needed} bytes of shared memory but the device allows {limit}; {remedy}")


class LaunchPlan(NamedTuple):
    """An op's launches with what they run on (a decode attention's, a cache write's): `out` is
    where they write (None: into the caches), `keep` holds every tensor whose address they carry and
    that nothing else may hold (a packed copy of the query or the rows, scratch), so it lives until
    they have run."""

    runner: Runner
    unit: Unit
    launches: list[Launch]
    out: torch.Tensor | None
    keep: tuple[object, ...]


class RunnerBackend(FusedLayerOpsMixin, TorchBackend):
    """Decode and prefill attention and the cache ops of kernels_cu/, for backends whose runner
    executes `Launch`es (cuda, emu); they support only the instantiated shapes."""

    head_sizes = NATIVE_HEAD_SIZES
    block_sizes = BLOCK_SIZES
    partition_sizes = NATIVE_PARTITION_SIZES
    cache_dtypes = CACHE_DTYPES
    # kernels_cu/ instantiates a cache in the activations' dtype or fp8 only
    converts_cache_dtype = False
    features = KERNEL_FEATURES

    @abstractmethod
    def runner(self, tensor: torch.Tensor) -> Runner:
        """The runner owning `tensor`'s device."""

    @abstractmethod
    def device_limits(self, device: torch.device) -> DeviceLimits:
        """What v3's split planner fills on `device`."""

    # The kernels skip slot -1 and read lengths on the device.
    graph_capturable = True

    def has_mma(self, device: torch.device) -> bool:
        """Whether `device` runs prefill.cuh's tensor-core path (`mma.sync`: sm_80 and newer)."""
        return True

    def prefill_path(self, dtype: torch.dtype, head_size: int, device: torch.device,
                     cache_dtype: torch.dtype | None = None) -> str:
        """Tensor cores for fp16 / bf16 on sm_80 and newer (an fp8 cache converted in registers),
        else CUDA cores (the same fragments, the same result), with the CTA's tiles."""
        tiles = prefill_tiles(dtype, head_size, cache_dtype)
        shape = f"{tiles.rows} rows x {tiles.keys} keys, {tiles.stages} K/V buffer" + "s" * (tiles.stages > 1)
        if dtype.itemsize != 2:
            return f"CUDA cores ({str(dtype).removeprefix('torch.')} has no tensor-core path), {shape}"
        if not self.has_mma(device):
            return f"CUDA cores (mma.sync needs sm_80), {shape}"
        fp8 = ", fp8 K/V converted in registers" if cache_dtype is not None and cache_dtype.itemsize == 1 else ""
        return f"tensor cores (mma.sync m16n8k16{fp8}), {shape}"

    def decode_workspace(
        self, num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, version: str,
        partition_size: int, max_seq_len: int, sliding_window: int | None, device: torch.device,
        cache_dtype: torch.dtype | None = None, num_splits: int | None = None, num_stages: int | None = None,
    ) -> V2Scratch | V3Workspace | None:
        """v2's per-partition exp sums, max logits and outputs, or v3's split plan (of `num_splits`
        splits and a `num_stages`-deep pipeline where given) and its scratch, for rows of up to
        `max_seq_len` over a `cache_dtype` cache (None: 16-bit)."""
        if version == "v3":
            return v3_workspace(self.device_limits(device), num_seqs, num_heads, num_kv_heads, head_size, block_size,
                                max_seq_len, sliding_window, device, num_splits=num_splits,
                                cache_element_size=2 if cache_dtype is None else cache_dtype.itemsize,
                                num_stages=num_stages)
        if version != "v2":
            return None
        num_partitions = -(-window_span(max_seq_len, sliding_window, partition_size) // partition_size)
        exp_sums = torch.empty((num_seqs, num_heads, num_partitions), dtype=torch.float32, device=device)
        tmp_out = torch.empty((num_seqs, num_heads, num_partitions, head_size), dtype=torch.float32, device=device)
        return V2Scratch(exp_sums, torch.empty_like(exp_sums), tmp_out)

    def paged_attention(
        self, query: torch.Tensor, cache: CacheView, scale: float, version: str, partition_size: int, max_seq_len: int,
        sliding_window: int | None, features: AttentionFeatures = NONE, workspace: object = None,
    ) -> torch.Tensor:
        plan = self.decode_launches(query, cache, scale, version, partition_size, max_seq_len, sliding_window,
                                    features, workspace)
        plan.runner.run(plan.unit, plan.launches)
        return plan.out

    def decode_launches(
        self, query: torch.Tensor, cache: CacheView, scale: float, version: str, partition_size: int, max_seq_len: int,
        sliding_window: int | None, features: AttentionFeatures = NONE, workspace: object = None,
    ) -> LaunchPlan:
        """`paged_attention`'s launches, not yet run (`paged.kernels.planned` runs a step's later
        layers from the first's launches).

        With a window, v1's logits and v2's partitions cover only the positions the window
        reaches: the kernels index them from the window's first block (v1) or partition (v2). v2's
        grid has a partition per `partition_size` of `max_seq_len`; those past a row's length
        return at once, so a longer `max_seq_len` (a CUDA graph's) gives the same output."""
        runner = self.runner(query)
        num_seqs, num_heads, head_size = query.shape
        key_cache, value_cache = cache.key_cache, cache.value_cache
        num_kv_heads, block_size = cache.num_kv_heads, cache.block_size
        _require_in_place_layout(key_cache=key_cache, value_cache=value_cache)
        query = _rows(query, vectors=True)
        block_tables, seq_lens = cache.block_tables.contiguous(), cache.seq_lens.contiguous()
        out = torch.empty_like(query)
        if version == "v3":
            v3 = workspace or self.decode_workspace(num_seqs, num_heads, num_kv_heads, head_size, block_size, version,
                                                    partition_size, max_seq_len, sliding_window, query.device,
                                                    key_cache.dtype)
            assert isinstance(v3, V3Workspace)
            unit, smem = v3_unit(query, cache, features.plain, v3.stages)
            _check_shared_memory(runner, unit, unit.kernels[0], smem, f"v3 attention with head size {head_size}",
                                 "use kernel.backend=torch, or a 16-bit model dtype")
            rows = CacheView(key_cache, value_cache, block_tables, seq_lens)
            launches = v3_launches(unit, smem, query, out, rows, scale, max_seq_len, sliding_window,
                                   _feature_args(cache, features), v3)
            return LaunchPlan(runner, unit, launches, out, (query, block_tables, seq_lens, v3))
        unit = attention_unit(query.dtype, head_size, block_size, version, partition_size, key_cache.dtype,
                              not features.plain)
        window = np.int32(sliding_window or 0)  # 0: the whole context
        common = (
            _ptr(query), _ptr(key_cache), _ptr(value_cache), np.int32(num_kv_heads), np.float32(scale),
            _ptr(block_tables), _ptr(seq_lens), np.int32(block_tables.shape[1]), np.int32(query.stride(0)),
            np.int32(key_cache.stride(0)), np.int32(key_cache.stride(1)), window, *_feature_args(cache, features),
        )
        # The logits buffer doubles as the cross-warp output buffer.
        outputs_smem = (NUM_THREADS // WARP_SIZE // 2) * head_size * 4
        scratch_tensors = None
        if version == "v1":
            padded_len = -(-window_span(max_seq_len, sliding_window, block_size) // block_size) * block_size
            smem = max(padded_len * 4, outputs_smem)
            _check_shared_memory(runner, unit, unit.kernels[0], smem, f"v1 attention over {max_seq_len} tokens")
            launches = [Launch(unit.kernels[0], (num_heads, num_seqs, 1), NUM_THREADS, smem, (_ptr(out), *common))]
        else:
            scratch_tensors = workspace or self.decode_workspace(
                num_seqs, num_heads, num_kv_heads, head_size, block_size, version, partition_size, max_seq_len,
                sliding_window, query.device)
            assert isinstance(scratch_tensors, V2Scratch)
            exp_sums, max_logits, tmp_out = scratch_tensors
            num_partitions = exp_sums.shape[2]
            smem = max(partition_size * 4, outputs_smem)
            reduce_smem = num_partitions * 4
            what = f"v2 attention over {max_seq_len} tokens"
            _check_shared_memory(runner, unit, unit.kernels[0], smem, what)
            _check_shared_memory(runner, unit, unit.kernels[1], reduce_smem, what)
            scratch = (_ptr(exp_sums), _ptr(max_logits), _ptr(tmp_out))
            launches = [
                Launch(unit.kernels[0], (num_heads, num_seqs, num_partitions), NUM_THREADS, smem, (*scratch, *common)),
                Launch(unit.kernels[1], (num_heads, num_seqs, 1), NUM_THREADS, reduce_smem,
                       (_ptr(out), *scratch, _ptr(seq_lens), np.int32(num_partitions), window)),
            ]
        return LaunchPlan(runner, unit, launches, out, (query, block_tables, seq_lens, scratch_tensors))

    def plan_prefill(
        self, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
        num_kv_heads: int, head_size: int, sliding_window: int | None, device: torch.device,
    ) -> None:
        """The kernel reads the rows' offsets and lengths on the device: nothing to plan."""
        return None

    def prefill_attention(
        self, query: torch.Tensor, cache: CacheView, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
        max_seq_len: int, sliding_window: int | None, features: AttentionFeatures = NONE, plan: object = None,
    ) -> torch.Tensor:
        launches = self.prefill_launches(query, cache, query_start_loc, scale, max_query_len, sliding_window, features)
        launches.runner.run(launches.unit, launches.launches)
        return launches.out

    def prefill_launches(
        self, query: torch.Tensor, cache: CacheView, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
        sliding_window: int | None, features: AttentionFeatures = NONE,
    ) -> LaunchPlan:
        """`prefill_attention`'s launch, not yet run (`paged.kernels.planned` runs a step's later
        layers from the first's launch): one for the batch, a CTA per 128 (fp16 / bf16 up to head
        128) or 64 (query, head) rows of a sequence and KV head, the grid sized by `max_query_len`
        (tiles past a sequence's rows return at once)."""
        runner = self.runner(query)
        num_heads, head_size = query.shape[1], query.shape[2]
        key_cache, value_cache = cache.key_cache, cache.value_cache
        _require_in_place_layout(key_cache=key_cache, value_cache=value_cache)
        query = _rows(query, vectors=True)
        block_tables, seq_lens = cache.block_tables.contiguous(), cache.seq_lens.contiguous()
        query_start_loc = query_start_loc.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        unit = prefill_unit(query.dtype, head_size, cache.block_size, key_cache.dtype, not features.plain)
        smem = prefill_shared_memory(query.dtype, head_size, key_cache.dtype)
        _check_shared_memory(runner, unit, unit.kernels[0], smem, f"{query.dtype} prefill attention with head size "
                             f"{head_size}", "use kernel.backend=torch, or a 16-bit model dtype")
        group = num_heads // cache.num_kv_heads
        rows = prefill_tiles(query.dtype, head_size, key_cache.dtype).rows
        grid = (-(-max_query_len * group // rows), cache.num_kv_heads, seq_lens.shape[0])
        args = (
            _ptr(out), _ptr(query), _ptr(key_cache), _ptr(value_cache), np.int32(num_heads),
            np.int32(cache.num_kv_heads), np.float32(scale), _ptr(block_tables), _ptr(seq_lens),
            _ptr(query_start_loc), np.int32(block_tables.shape[1]), np.int32(query.stride(0)),
            np.int32(key_cache.stride(0)), np.int32(key_cache.stride(1)), np.int32(sliding_window or 0),
            *_feature_args(cache, features),
        )
        launches = [Launch(unit.kernels[0], grid, PREFILL_WARPS * WARP_SIZE, smem, args)]
        return LaunchPlan(runner, unit, launches, out, (query, block_tables, seq_lens, query_start_loc))

    def reshape_and_cache(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
        has_padding: bool = True,
    ) -> None:
        plan = self.cache_write_launches(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        if plan is not None:
            plan.runner.run(plan.unit, plan.launches)

    def cache_write_launches(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> LaunchPlan | None:
        """`reshape_and_cache`'s launch, not yet run; None for no tokens (`paged.kernels.planned`
        runs a step's later layers from the first's launch)."""
        runner = self.runner(key)
        num_tokens, num_heads, head_size = key.shape
        if num_tokens == 0:
            return None
        _require_in_place_layout(key_cache=key_cache, value_cache=value_cache)
        key, value = _rows(key, vectors=False), _rows(value, vectors=False)
        slot_mapping = slot_mapping.contiguous()
        unit = cache_unit(key.dtype, key_cache.dtype)
        args = (
            _ptr(key), _ptr(value), _ptr(key_cache), _ptr(value_cache), _ptr(slot_mapping),
            np.int32(key.stride(0)), np.int32(value.stride(0)), np.int32(num_heads), np.int32(head_size),
            np.int32(key_cache.shape[3]), np.int32(key_cache.shape[4]), _optional_ptr(k_scale), _optional_ptr(v_scale),
        )
        threads = min(num_heads * head_size, MAX_CACHE_THREADS)
        return LaunchPlan(runner, unit, [Launch(unit.kernels[0], (num_tokens, 1, 1), threads, 0, args)], None,
                          (key, value, slot_mapping))

    def copy_blocks(
        self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
    ) -> None:
        runner = self.runner(key_caches[0])
        if block_mapping.numel() == 0:
            return
        for layer, (k, v) in enumerate(zip(key_caches, value_caches)):
            _require_in_place_layout(**{f"key_caches[{layer}]": k, f"value_caches[{layer}]": v})
        device = key_caches[0].device
        # through pinned memory, so the copies are queued and the host does not wait for the device
        key_ptrs = to_device(np.array([c.data_ptr() for c in key_caches], dtype=np.int64), device)
        value_ptrs = to_device(np.array([c.data_ptr() for c in value_caches], dtype=np.int64), device)
        mapping = block_mapping if block_mapping.device == device else to_device(block_mapping.numpy(), device)
        mapping = mapping.contiguous()
        numel_per_block = key_caches[0][0].numel()
        unit = cache_unit(key_caches[0].dtype)
        grid = (len(key_caches), mapping.shape[0], 1)
        args = (_ptr(key_ptrs), _ptr(value_ptrs), _ptr(mapping), np.int32(numel_per_block))
        runner.run(unit, [Launch(unit.kernels[1], grid, min(numel_per_block, MAX_COPY_THREADS), 0, args)])

    def copy_slots(
        self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], slot_mapping: torch.Tensor
    ) -> None:
        """Per layer a gather of the source slots into a buffer, then a scatter into the destinations
        (kernels_cu/cache.cuh's move_slots_kernel): a destination may be another pair's source."""
        if slot_mapping.numel() == 0:
            return
        runner = self.runner(key_caches[0])
        device = key_caches[0].device
        mapping = slot_mapping if slot_mapping.device == device else to_device(slot_mapping.numpy(), device)
        mapping = mapping.contiguous()
        _, num_heads, _, block_size, x = key_caches[0].shape
        head_size = value_caches[0].shape[2]
        buffers = [torch.empty(mapping.shape[0], num_heads * head_size, dtype=key_caches[0].dtype, device=device)
                   for _ in range(2)]
        unit = cache_unit(key_caches[0].dtype)
        threads = min(num_heads * head_size, MAX_CACHE_THREADS)
        launches = []
        for layer, (k, v) in enumerate(zip(key_caches, value_caches)):
            _require_in_place_layout(**{f"key_caches[{layer}]": k, f"value_caches[{layer}]": v})
            common = (_ptr(k), _ptr(v), *map(_ptr, buffers), _ptr(mapping), *map(np.int32, (num_heads, head_size,
                                                                                           block_size, x)))
            launches += [Launch(unit.kernels[2], (mapping.shape[0], 1, 1), threads, 0, (*common, np.int32(phase)))
                         for phase in (0, 1)]
        # the buffers may go when this returns: torch's allocator hands their memory only to later work
        # on the stream the launches are queued on
        runner.run(unit, launches)

    def attention_mass(
        self, query: torch.Tensor, cache: CacheView, query_start_loc: np.ndarray, scale: float,
        last_queries: int | None = None, soft_cap: float | None = None,
    ) -> torch.Tensor:
        """kernels_cu/attention_mass.cuh (`mass_plan`); what it cannot read (a cache of another dtype
        than the queries', a head over 256) is scored by the torch reference."""
        if unsupported(query, cache) is not None:
            return super().attention_mass(query, cache, query_start_loc, scale, last_queries, soft_cap)
        return run_attention_mass(self.runner(query), query, cache, query_start_loc, scale, last_queries, soft_cap)

    def swap_blocks(
        self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], block_mapping: torch.Tensor
    ) -> None:
        runner = self.runner(device_side(src_caches, dst_caches))
        if runner.needs_pinned_host:
            require_pinned(**{f"src_caches[{i}]": c for i, c in enumerate(src_caches)},
                            **{f"dst_caches[{i}]": c for i, c in enumerate(dst_caches)})
        runner.copy(copy_plan(src_caches, dst_caches, block_mapping))
