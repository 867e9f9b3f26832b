"""The executor seam: what the engine and the builder need from whatever runs a step.

The real model (`ModelExecutor`) and a simulated GPU both implement `Executor`. The builder
constructs one from `executor._target_` as `cls(model=cfg.model, kernel=cfg.kernel, seed=cfg.seed,
**its own settings)`, asks `kv_cache_spec` what a block costs, sizes the cache, calls
`init_kv_cache`, and the engine then calls `execute` once per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from paged.clock import Clock, WallClock
from paged.config import ConfigError, KernelConfig
from paged.executor.output import ExecutorOutput
from paged.scheduler.output import SchedulerOutput


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
    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate `num_blocks` blocks; called again when an engine reuses this executor."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        """Copy `sched.blocks_to_copy`, compute the scheduled tokens, sample where asked."""

    # Whether a model without weights (`model.source=spec`) is enough to run.
    runs_spec_models: bool = False
    # Token ids run from 0 to vocab_size - 1: what synthetic workloads draw from without a tokenizer.
    vocab_size: int | None = None

    def kv_cache_budget(self, utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Bytes for the KV cache when the config gives no size: `utilization` of the device memory,
        less weights and the activation peak of a `max_num_batched_tokens` step."""
        raise ConfigError(
            f"{type(self).__qualname__} cannot size the KV cache from device memory; "
            "set allocator.num_blocks or allocator.kv_cache_memory (e.g. 256MiB)"
        )

    def configure_kernel(self, kernel: KernelConfig) -> None:  # noqa: B027 - optional hook
        """Re-read the kernel settings when a new engine reuses this executor; no-op by default."""

    @cached_property
    def clock(self) -> Clock:
        """The time the engine runs on: the wall clock, unless the executor simulates time."""
        return WallClock()
