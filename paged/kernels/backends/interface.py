"""The contract every kernel backend implements: what it supports, and the five ops.

The front end (`paged.kernels.ops`) checks shapes, dtypes and devices once for every backend, then
asks the backend whether it can serve the configuration (`unsupported_reason`) before calling it;
`resolve_backend` asks the same question to pick a backend for `auto`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from paged.kernels.backends import slot_copy
from paged.kernels.features import FP8_DTYPES, NONE, AttentionFeatures
from paged.kernels.limits import DTYPE_NAMES

DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, name) for name in DTYPE_NAMES)
# What a KV cache may hold: a model dtype (the model's own, or another one it is converted to), or fp8 with
# scales.
CACHE_DTYPES: tuple[torch.dtype, ...] = DTYPES + FP8_DTYPES
FEATURES = ("alibi", "blocksparse", "softcap")
# What the native kernels (cpu, cuda, emu) implement: soft-capping runs on the torch backend only.
KERNEL_FEATURES = ("alibi", "blocksparse")


def _text(value: object) -> str:
    return str(value).removeprefix("torch.")


def listing(values: Iterable[object]) -> str:
    """`a, b, c`, with dtypes written as `float16` rather than `torch.float16`."""
    return ", ".join(map(_text, values))


def window_span(max_seq_len: int, sliding_window: int | None, align: int) -> int:
    """The most positions attention covers from a window start rounded down to a multiple of
    `align` (a block, a partition) to the end of a context of at most `max_seq_len`: the window's
    start lies at most `align - 1` past the rounded one."""
    return max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + align - 1)


def device_side(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor]) -> torch.Tensor:
    """The cache whose device runs a swap: the accelerator's side, the destination when both pools
    are on the CPU."""
    return src_caches[0] if src_caches[0].device.type != "cpu" else dst_caches[0]


def require_contiguous(**caches: torch.Tensor) -> None:
    """Native ops read and write caches where they are, at `block * stride(0)`, so a cache cannot
    be copied into shape first."""
    for name, cache in caches.items():
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous for native kernels (they index it in place), "
                             f"got strides {cache.stride()}")


@dataclass(frozen=True)
class CacheView:
    """One layer's paged K/V cache as a batch's sequences see it (layouts in DESIGN.md):
    `block_tables` int32 `[num_seqs, max_blocks]`, `seq_lens` int32 `[num_seqs]`; an fp8 cache
    carries its fp32 `[num_kv_heads]` dequantisation scales (`paged.kernels.features`)."""

    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, head_size / x, block_size, x]
    value_cache: torch.Tensor  # [num_blocks, num_kv_heads, head_size, block_size]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.key_cache.dtype in FP8_DTYPES

    @property
    def num_kv_heads(self) -> int:
        return self.value_cache.shape[1]

    @property
    def head_size(self) -> int:
        return self.value_cache.shape[2]

    @property
    def block_size(self) -> int:
        return self.value_cache.shape[3]


class KernelBackend(ABC):
    """A backend: its declared support, and the ops on arguments the front end already checked.

    A support field of `None` means any value the backend-agnostic checks accept; `device_type`
    `None` means tensors on any device.
    """

    name: ClassVar[str]
    description: ClassVar[str]  # how it runs, for logs: "native C++/OpenMP"
    device_type: ClassVar[str | None] = None
    dtypes: ClassVar[tuple[torch.dtype, ...]] = DTYPES
    head_sizes: ClassVar[tuple[int, ...] | None] = None
    block_sizes: ClassVar[tuple[int, ...] | None] = None
    partition_sizes: ClassVar[tuple[int, ...] | None] = None
    # KV cache dtypes besides the model's own: a backend that declares none stores K/V as they come.
    cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = DTYPES
    # Whether a cache of another float dtype than the activations' (a bfloat16 model over a float32
    # cache) is served: written converted, read as fp32. A backend that cannot refuses such a pair.
    converts_cache_dtype: ClassVar[bool] = False
    # The `AttentionFeatures` it implements, of FEATURES.
    features: ClassVar[tuple[str, ...]] = ()
    # Whether a CUDA graph can capture its decode step: its ops read nothing on the host, allocate
    # nothing a replay would need anew, and skip padding rows (slot -1) on the device.
    graph_capturable: ClassVar[bool] = False

    def unsupported_reason(
        self,
        device: torch.device,
        dtype: torch.dtype,
        head_size: int | None,
        block_size: int | None,
        partition_size: int | None = None,
        cache_dtype: torch.dtype | None = None,
        features: AttentionFeatures = NONE,
    ) -> str | None:
        """Why this backend cannot serve the configuration, naming the value and what it supports;
        `None` when it can. A `None` value is not checked: a block size not known yet, a partition
        size where v2 never runs, the cache dtype of an op that reads no cache."""
        declared = (
            ("dtype", dtype, self.dtypes),
            ("kv cache dtype", cache_dtype, self.cache_dtypes),
            ("head_size", head_size, self.head_sizes),
            ("block_size", block_size, self.block_sizes),
            ("partition_size", partition_size, self.partition_sizes),
            *(("attention feature", name, self.features) for name in features.names),
        )
        for what, value, supported in declared:
            if value is not None and supported is not None and value not in supported:
                return (
                    f"{what}={_text(value)} is not supported by backend={self.name!r}; supported: "
                    f"{listing(supported) or 'none'}"
                )
        if not self.converts_cache_dtype and dtype is not None and cache_dtype is not None and (
                cache_dtype not in FP8_DTYPES and cache_dtype != dtype):
            allowed = (dtype, *(d for d in self.cache_dtypes if d in FP8_DTYPES))
            return (f"kv cache dtype={_text(cache_dtype)} with dtype={_text(dtype)} is not supported by "
                    f"backend={self.name!r}, which keeps a float cache in the activations' dtype; supported: "
                    f"{listing(allowed)}")
        if self.device_type is not None and device.type != self.device_type:
            return f"backend={self.name!r} needs {self.device_type} tensors, got tensors on {device}"
        return None

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run in this process (no compiler, no CUDA toolchain); `None`
        when it can. May build the backend's library on first call."""
        return None

    def prefill_path(self, dtype: torch.dtype, head_size: int, device: torch.device,
                     cache_dtype: torch.dtype | None = None) -> str | None:
        """How `prefill_attention` computes for a model of `dtype` and `head_size` on `device` with a
        `cache_dtype` cache (None: `dtype`), for the executor's description; `None` (the default)
        for a backend with one way."""
        return None

    def decode_workspace(
        self, num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, version: str,
        partition_size: int, max_seq_len: int, sliding_window: int | None, device: torch.device,
        cache_dtype: torch.dtype | None = None, num_splits: int | None = None, num_stages: int | None = None,
    ) -> object:
        """Scratch that `paged_attention` would otherwise allocate on every call, made once for a
        step's decode rows and passed to each layer's call as `workspace` (v3's split plan reads a
        `cache_dtype` cache's bytes: None, a 16-bit one; `num_splits` forces its split count and
        `num_stages` its K/V pipeline's depth, for a benchmark sweeping them); `None` (the default)
        for a backend that needs none."""
        return None

    def plan_prefill(
        self, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
        num_kv_heads: int, head_size: int, sliding_window: int | None, device: torch.device,
    ) -> object:
        """What `prefill_attention` would derive from the rows' metadata on every call, derived
        once per step from its host copies (so without waiting for the device) and passed to each
        layer's call as `plan`; `None` (the default) for a backend that needs nothing."""
        return None

    @abstractmethod
    def paged_attention(
        self, query: torch.Tensor, cache: CacheView, scale: float, version: str, partition_size: int, max_seq_len: int,
        sliding_window: int | None, features: AttentionFeatures = NONE, workspace: object = None,
    ) -> torch.Tensor:
        """`paged.kernels.paged_attention` on a non-empty batch; `sliding_window` is `None` or
        shorter than `max_seq_len`; an fp8 cache has its scales set; `workspace` is what
        `decode_workspace` made for these rows, or `None`."""

    @abstractmethod
    def prefill_attention(
        self, query: torch.Tensor, cache: CacheView, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
        max_seq_len: int, sliding_window: int | None, features: AttentionFeatures = NONE, plan: object = None,
    ) -> torch.Tensor:
        """`paged.kernels.prefill_attention` on a non-empty batch; `sliding_window` is `None` or
        shorter than `max_seq_len`; an fp8 cache has its scales set; `plan` is what `plan_prefill`
        made for these rows, or `None`."""

    @abstractmethod
    def reshape_and_cache(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
        has_padding: bool = True,
    ) -> None:
        """`paged.kernels.reshape_and_cache`; fp8 caches get fp32 `[num_kv_heads]` scales.
        `has_padding=False`: the caller knows no slot is -1, so none needs skipping."""

    @abstractmethod
    def copy_blocks(
        self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
    ) -> None:
        """`paged.kernels.copy_blocks` with an int64 `[num_pairs, 2]` mapping."""

    @abstractmethod
    def swap_blocks(
        self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], block_mapping: torch.Tensor
    ) -> None:
        """`paged.kernels.swap_blocks` with a non-empty int64 `[num_pairs, 2]` mapping on the CPU."""

    def attention_mass(
        self, query: torch.Tensor, cache: CacheView, query_start_loc: np.ndarray, scale: float,
        last_queries: int | None = None, soft_cap: float | None = None,
    ) -> torch.Tensor:
        """fp32 `[num_seqs, num_kv_heads, max_seq_len]`: each row's mass on each of its `seq_lens[i]`
        cached tokens from its last `last_queries` queries (None: all), summed over them and over the
        query heads of each KV group (`paged.kernels.backends.torch_mass`, the reference). Only asked
        when a KV press scores tokens; never part of the attention ops' default path."""
        raise NotImplementedError(f"backend={self.name!r} gives no attention mass, which kv_press=snapkv|h2o read")

    def copy_slots(
        self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], slot_mapping: torch.Tensor
    ) -> None:
        """`paged.kernels.copy_slots` with an int64 `[num_pairs, 2]` mapping: torch's gather and
        scatter wherever the caches are (the torch backend's; cpu, cuda and emu have kernels)."""
        slot_copy.copy_slots(key_caches, value_caches, slot_mapping)
