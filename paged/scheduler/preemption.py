"""The preemption seam: what taking a request's running sequences' blocks does to their KV.

`scheduler.preemption_mode` picks a built-in mode: `recompute` frees the blocks and recomputes the
sequence's tokens as a prefill (chunked like any prompt) when it is admitted again; `swap` parks its
KV in the CPU pool, from which the scheduler's swapped queue brings it back before any waiting
request is admitted; `auto` is vLLM V0's rule (swap a request that has several running sequences,
recompute a lone one). A request's sequences are preempted together (gang scheduling), and a swap
keeps the blocks they share shared. A prompt still being computed is always recomputed. A custom
mode is a `PreemptionMode` named by `scheduler.preemption._target_`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from paged.memory import BlockManager
from paged.request import Sequence
from paged.step import SchedulerOutput


class PreemptionMode(ABC):
    # Whether the mode needs a CPU swap pool (allocator.swap_space) and an executor that swaps.
    swaps: ClassVar[bool] = False
    # swaps that found the CPU pool full and recomputed instead (incremented per instance)
    num_recompute_fallbacks: int = 0

    @abstractmethod
    def preempt(self, seqs: list[Sequence], block_manager: BlockManager, out: SchedulerOutput) -> bool:
        """Release the device blocks of `seqs` (one request's running sequences); True when their KV
        was swapped out (the scheduler then puts them in the swapped queue), False when they must be
        recomputed (the waiting queue)."""


def recompute(seqs: list[Sequence], block_manager: BlockManager) -> bool:
    for seq in seqs:
        block_manager.free(seq)
        seq.num_computed_tokens = 0
    return False


class RecomputePreemption(PreemptionMode):
    """vLLM's default: free the blocks; prompt and generated tokens are recomputed as a prefill."""

    def preempt(self, seqs: list[Sequence], block_manager: BlockManager, out: SchedulerOutput) -> bool:
        return recompute(seqs, block_manager)


class SwapPreemption(PreemptionMode):
    """Copy the sequence's filled blocks to the CPU pool; recompute when the pool cannot hold them."""

    swaps = True

    def preempt(self, seqs: list[Sequence], block_manager: BlockManager, out: SchedulerOutput) -> bool:
        if block_manager.can_swap_out(*seqs):
            out.blocks_to_swap_out.extend(block_manager.swap_out(*seqs))
            return True
        self.num_recompute_fallbacks += 1
        return recompute(seqs, block_manager)


class AutoPreemption(SwapPreemption):
    """vLLM V0: swap when the request has several running sequences (samples sharing blocks would
    each be recomputed), recompute a request's only sequence."""

    def preempt(self, seqs: list[Sequence], block_manager: BlockManager, out: SchedulerOutput) -> bool:
        if len(seqs) > 1:
            return super().preempt(seqs, block_manager, out)
        return recompute(seqs, block_manager)


MODES: dict[str, type[PreemptionMode]] = {
    "recompute": RecomputePreemption,
    "swap": SwapPreemption,
    "auto": AutoPreemption,
}
