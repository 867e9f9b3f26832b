"""What the block manager keeps per sequence (`_SeqBlocks`) and its admission answers (`AllocStatus`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class AllocStatus(enum.Enum):
    OK = "ok"
    LATER = "later"
    NEVER = "never"


@dataclass(slots=True)
class _SeqBlocks:
    table: list[int]
    num_slots: int  # token slots filled, i.e. seq.num_tokens at the last allocate/append
    final: int  # slots the sequence fills before its length limit: what its reservation is for
    num_published: int = 0  # leading blocks already inserted into the prefix cache
    # leading blocks freed as wholly before the sliding window (stale ids the kernels never read)
    num_dropped: int = 0
    # leading blocks announced as being computed (from `num_published` on, until published or
    # freed): what waiting requests with the same prefix can wait for
    num_announced: int = 0
