"""Toy plugins, each with a constructor setting of its own, that plug in through config alone
(`_target_` plus their settings in a YAML), proving the seams are open."""

from __future__ import annotations

from paged.config import KernelConfig, ModelConfig
from paged.memory import NaiveAllocator, Reservation
from paged.model.locate import locate_smollm2
from paged.model.tokenizer import load_tokenizer
from paged.request import Sequence
from paged.scheduler.policy import SchedulingPolicy
from tests.token_cache_executor import TokenCacheExecutor


class CountingAllocator(NaiveAllocator):
    """Counts every allocation, so a test can see the engine really used it."""

    calls = 0

    def allocate(self) -> int:
        type(self).calls += 1
        return super().allocate()


class CappedAllocator(NaiveAllocator):
    """Manages only the first `max_blocks` blocks of the cache, however many it holds."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks: int) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be > 0, got {max_blocks}")
        super().__init__(min(num_blocks, max_blocks), block_size)


class HoldingAllocator(NaiveAllocator):
    """Keeps `held` blocks allocated for good, as if another tenant used them."""

    def __init__(self, num_blocks: int, block_size: int, held: int) -> None:
        super().__init__(num_blocks, block_size)
        for _ in range(held):
            self.allocate()


class PromptLengthPolicy(SchedulingPolicy):
    """Admits by prompt length, longest first unless `longest_first=false`; preempts the other end."""

    def __init__(self, longest_first: bool = True) -> None:
        self.sign = -1 if longest_first else 1

    def admission_key(self, seq: Sequence, now: float) -> tuple[int, int]:
        return (self.sign * seq.num_prompt_tokens, seq.seq_id)

    def victim_key(self, seq: Sequence, now: float) -> tuple[int, int]:
        return (self.sign * seq.num_prompt_tokens, seq.seq_id)


class LongestPromptFirstPolicy(PromptLengthPolicy):
    """The opposite of SJF, with no settings."""

    def __init__(self) -> None:
        super().__init__(longest_first=True)


class ReserveMaxLen(Reservation):
    """Orca-style: reserve `max_model_len` slots at admission, so growth never allocates."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

    def admission_slots(self, seq: Sequence) -> int:
        return self.max_model_len


class ToyExecutor(TokenCacheExecutor):
    """The token-cache executor as a config plugin: it takes the SmolLM2 tokenizer's ids in prompts
    (its vocabulary) and samples among the first `vocab_size` of them."""

    def __init__(self, model: ModelConfig, kernel: KernelConfig, seed: int = 0, vocab_size: int = 1000) -> None:
        super().__init__(vocab_size)
        self.tokenizer = load_tokenizer(locate_smollm2())
        self.vocab_size = self.tokenizer.vocab_size
