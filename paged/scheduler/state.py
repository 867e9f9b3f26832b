"""The scheduler state its halves share: `Scheduler.__init__` sets it, and the mixins that make up
`Scheduler` (update, lagged update, hand-off, steady step) read and change it, declared once here."""

from __future__ import annotations

from paged.memory import BlockManager
from paged.request import Request, Sequence
from paged.scheduler.policy import SchedulingPolicy
from paged.scheduler.sequence_group import SequenceGroup


class SchedulerState:
    """The queues, the block manager, the policy and the stopping limits every half of the scheduler reads."""

    block_manager: BlockManager
    policy: SchedulingPolicy
    running: list[Sequence]
    waiting: list[Sequence]
    swapped: list[Sequence]
    eos_token_ids: frozenset[int]
    max_model_len: int
    _groups: dict[Request, SequenceGroup]
    _now: float
