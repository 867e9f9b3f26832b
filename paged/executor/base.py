"""The executor seam: what the engine and the builder need from whatever runs a step.

The real model (`ModelExecutor`) and a simulated GPU both implement `Executor`. The builder
constructs one from `executor._target_` as `cls(model=cfg.model, kernel=cfg.kernel, seed=cfg.seed,
**its own settings)`, asks `kv_cache_spec` what a block costs (on the device, and as much in swap
space) and, when the config gives no size, `kv_cache_budget` how many bytes the cache may take; it
sizes the cache, calls `init_kv_cache`, and the engine then calls `execute` once per step.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from paged.config import ConfigError, KernelConfig
from paged.executor.pending import PendingOutput, ReadyOutput
from paged.kernels.limits import BLOCK_SIZES
from paged.kv_layout import KVLayout
from paged.memory.kv_tiers import TierStore
from paged.step import ExecutorOutput, SchedulerOutput
from paged.utils.clock import Clock, WallClock
from paged.utils.threads import ThreadChoice


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class KVCacheSpec:
    """What one KV block of `block_size` tokens costs on the device, and how it is laid out."""

    block_size: int
    bytes_per_block: int
    layout: str


class Executor(ABC):
    # Token ids that end a sequence (unless its request sets ignore_eos).
    eos_token_ids: frozenset[int] = frozenset()
    # Text <-> ids, when the executor has a vocabulary; None means requests arrive as token ids.
    tokenizer: Tokenizer | None = None
    # The attention kernel that runs (summary.json's `attention_kernel`), if the executor has one.
    kernel_description: str | None = None

    @property
    @abstractmethod
    def description(self) -> str:
        """One line for logs and summary.json: what runs and where."""

    @abstractmethod
    def kv_cache_spec(self, block_size: int) -> KVCacheSpec: ...

    @abstractmethod
    def init_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        """Allocate `num_blocks` device blocks and `num_cpu_blocks` swap-space blocks in host memory
        (same layout; 0: no swap space); called again when an engine reuses this executor."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        """Swap `sched.blocks_to_swap_out` to host and `sched.blocks_to_swap_in` back, copy
        `sched.blocks_to_copy`, compute the scheduled tokens, sample where asked. A step may carry
        swaps and no scheduled sequence: the swaps still happen."""

    def launch(self, sched: SchedulerOutput) -> PendingOutput:
        """Start a step under async scheduling (`set_async_scheduling`): its output later, or now.
        By default the step runs to its end (`execute`)."""
        return ReadyOutput(self.execute(sched))

    # Whether it runs KV compression (`kv_press`): copies `SchedulerOutput.slots_to_compact`, attends to
    # each row's held tokens (`kv_offsets`), and returns `ExecutorOutput.kv_norms` when asked
    supports_kv_press: bool = False

    # Whether `launch` can leave a step's sampled tokens on the device (scheduler.async_scheduling)
    supports_async_scheduling: bool = False
    # Whether it does: the engine launches each step before it reads the previous one's tokens
    async_scheduling: bool = False

    @classmethod
    def async_scheduling_refusal(cls, settings: Mapping[str, Any]) -> str | None:
        """Why this executor, built with `settings` (its config node's), cannot run async
        scheduling; None when it can."""
        if not cls.supports_async_scheduling:
            return f"{cls.__qualname__} computes each step before it returns it, so no step can be scheduled ahead"
        return None

    def set_async_scheduling(self, on: bool) -> None:
        """Given before `init_kv_cache`: whether steps are launched ahead of their predecessor's
        tokens (the builder checked `async_scheduling_refusal` first)."""
        if on and not self.supports_async_scheduling:
            raise ConfigError(f"scheduler.async_scheduling=true: {self.async_scheduling_refusal({})}")
        self.async_scheduling = on

    # Whether a model without weights (`model.source=spec`) is enough to run.
    runs_spec_models: bool = False
    # Token ids run from 0 to vocab_size - 1: what synthetic workloads draw from without a tokenizer.
    vocab_size: int | None = None
    # allocator.block_size values it runs: the kernels' (a simulator has no kernel to constrain them)
    block_sizes: tuple[int, ...] = BLOCK_SIZES
    # Whether `execute` moves `blocks_to_swap_out` / `blocks_to_swap_in` (swap preemption needs it).
    supports_swap: bool = False
    # Whether `execute` moves the prefix tiers' `blocks_to_offload` / `blocks_to_onload` (their host
    # blocks follow the swap pool's) and `kv_tier_store` gives a disk tier: `allocator.offload` needs it.
    supports_kv_tiers: bool = False
    # Devices the KV cache is split over: the CPU swap pool is `allocator.swap_space` per device.
    num_devices: int = 1
    # The model's attention window in tokens (None: full attention); the block manager frees blocks
    # that fall wholly outside it.
    sliding_window: int | None = None
    # The host threads it computes on (paged.utils.threads); None: it runs no model (a simulator)
    threads: ThreadChoice | None = None
    # Per layer, its attention window in tokens (None: full attention); the builder groups layers by
    # it (`allocator.kv_groups`) and hands the layout back through `set_kv_layout`.
    layer_windows: tuple[int | None, ...] = ()
    # How layers share block tables and KV tensors; None until the builder sets it (one group then)
    kv_layout: KVLayout | None = None

    def set_kv_layout(self, layout: KVLayout) -> None:
        """The KV layout the block manager keeps tables for, given before `kv_cache_spec` and
        `init_kv_cache`: a block then holds `layout.num_slots` layers."""
        self.kv_layout = layout

    def kv_tier_store(self, directory: str) -> TierStore:
        """The disk tier's store for evicted prefix blocks (`paged.memory.kv_tiers`), under `directory`."""
        raise NotImplementedError(f"{type(self).__qualname__} keeps no tiers for evicted prefixes")

    def host_memory_bytes(self) -> int | None:
        """Host memory the swap pool must fit in: this machine's RAM; None where the pool is only
        bookkeeping (a simulator)."""
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def kv_cache_budget(self, utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> int | None:
        """Bytes for the KV cache when the config gives no size: `utilization` of the device memory,
        less weights and the activation peak of a `max_num_batched_tokens` step of `max_num_seqs`
        sequences. None (this default): the executor has no device memory to share, and the builder
        uses its default block count."""
        return None

    def set_batch_limits(  # noqa: B027 - optional hook
        self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> None:
        """The scheduler's bounds on a step, given before `init_kv_cache`: what an executor that
        prepares work per batch shape (CUDA graphs) plans for; no-op by default."""

    def decode_step_counts(self) -> dict[str, int | None]:
        """summary.json's `cuda_graph_steps` (steps replayed from a CUDA graph), `eager_decode_steps`
        (decode-only steps run op by op) and `eager_mixed_steps` (steps with prompt tokens run op by
        op); None where no step runs a model."""
        return {"cuda_graph_steps": None, "eager_decode_steps": None, "eager_mixed_steps": None}

    def configure_kernel(self, kernel: KernelConfig) -> None:  # noqa: B027 - optional hook
        """Re-read the kernel settings when a new engine reuses this executor; no-op by default."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Stop what the executor started (tensor-parallel worker processes); it runs no step after.
        No-op by default; a `ModelExecutor`'s workers also stop when it is collected."""

    @cached_property
    def clock(self) -> Clock:
        """The time the engine runs on: the wall clock, unless the executor simulates time."""
        return WallClock()
