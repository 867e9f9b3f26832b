"""The reservation seam: how many token slots a sequence's block table covers.

Paged allocation covers exactly the tokens a sequence has (`ExactReservation`), one block at a time
as it grows. A reservation baseline (Orca's: reserve the maximum length at admission) is another
`Reservation`: the block manager asks it at admission and before every growth step, so such a
baseline is a plugin (`allocator.reservation._target_`), not a fork of `BlockManager`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from paged.request import Sequence


class Reservation(ABC):
    @abstractmethod
    def admission_slots(self, seq: Sequence) -> int:
        """Token slots `seq`'s table must cover when it is admitted (at least `seq.num_tokens`)."""

    def growth_slots(self, seq: Sequence) -> int:
        """Token slots the table must cover before a step that grows `seq` to `seq.num_tokens`."""
        return self.admission_slots(seq)


class ExactReservation(Reservation):
    """PagedAttention: a block is allocated only when a token needs a slot in it."""

    def admission_slots(self, seq: Sequence) -> int:
        return len(seq.token_ids)

    # asked before every decode step of every sequence: skip the base class's indirection
    growth_slots = admission_slots
