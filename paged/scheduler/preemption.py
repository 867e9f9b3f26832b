"""The preemption seam: what taking a running sequence's blocks does to its KV, and how it returns.

Every waiting sequence, fresh or preempted, is admitted through the mode, so a mode that parks KV
somewhere else (swap to a CPU pool) can bring it back instead of allocating and recomputing.
Chosen by `scheduler.preemption._target_`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from paged.memory import AllocStatus, BlockManager
from paged.request import Sequence
from paged.scheduler.output import SchedulerOutput


class PreemptionMode(ABC):
    @abstractmethod
    def preempt(self, seq: Sequence, block_manager: BlockManager, out: SchedulerOutput) -> None:
        """Release `seq`'s device blocks; the scheduler then moves it back to the waiting queue."""

    def can_admit(self, seq: Sequence, block_manager: BlockManager) -> AllocStatus:
        return block_manager.can_allocate(seq)

    def admit(self, seq: Sequence, block_manager: BlockManager, out: SchedulerOutput) -> int:
        """Give `seq` blocks for all its tokens; returns how many of them already hold KV."""
        return block_manager.allocate(seq)


class RecomputePreemption(PreemptionMode):
    """vLLM's default: free the blocks; prompt and generated tokens are recomputed as one prefill."""

    def preempt(self, seq: Sequence, block_manager: BlockManager, out: SchedulerOutput) -> None:
        block_manager.free(seq)
        seq.num_computed_tokens = 0
