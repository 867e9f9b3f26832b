"""The reservation seam: how many token slots a sequence's block table covers.

Paged allocation covers exactly the tokens a sequence has (`ExactReservation`), one block at a time
as it grows. The PagedAttention paper's Orca baselines reserve a request's slots up front: the
maximum length (`MaxReservation`), the next power of two of its final length (`Pow2Reservation`),
or exactly its final length, which only an oracle knows (`OracleReservation`). The block manager
asks the reservation at admission and before every growth step, so a baseline is a plugin
(`allocator.reservation._target_`), not a fork of `BlockManager`; paired with the buddy allocator
each reservation is one contiguous extent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from paged.request import Request, Sequence


def final_length(request: Request, max_model_len: int | None) -> int:
    """The most tokens a sequence of `request` can reach: its prompt plus `max_tokens`, capped by
    `max_model_len`. The true final length when nothing else stops it (`ignore_eos`)."""
    length = request.num_prompt_tokens + request.params.max_tokens
    return length if max_model_len is None else min(length, max_model_len)


class Reservation(ABC):
    # Whether the reservation must know each request's true output length (oracle baselines).
    needs_output_lengths: ClassVar[bool] = False

    @abstractmethod
    def admission_slots(self, seq: Sequence) -> int:
        """Token slots `seq`'s table must cover when it is admitted (at least `seq.num_tokens`)."""

    def growth_slots(self, seq: Sequence) -> int:
        """Token slots the table must cover before a step that grows `seq` to `seq.num_tokens`."""
        return self.admission_slots(seq)

    def rejection(self, request: Request) -> str | None:
        """Why `request` cannot be served under this reservation (it is then aborted); None if it can."""
        return None


class ExactReservation(Reservation):
    """PagedAttention: a block is allocated only when a token needs a slot in it."""

    def admission_slots(self, seq: Sequence) -> int:
        return len(seq.token_ids)

    # asked before every decode step of every sequence: skip the base class's indirection
    growth_slots = admission_slots


class _UpFront(Reservation):
    """Reserve a request's slots at admission; growth never needs more."""

    def __init__(self, max_model_len: int) -> None:
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len <= 0:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        self.max_model_len = max_model_len

    def admission_slots(self, seq: Sequence) -> int:
        return max(seq.num_tokens, min(self._reserve(seq.request), self.max_model_len))

    @abstractmethod
    def _reserve(self, request: Request) -> int:
        """Slots reserved for each sequence of `request` (capped at `max_model_len`)."""


class MaxReservation(_UpFront):
    """Orca (Max): every request reserves `max_model_len` slots."""

    def _reserve(self, request: Request) -> int:
        return self.max_model_len


class Pow2Reservation(_UpFront):
    """Orca (Pow2): the prompt plus the next power of two of the output length ("32 positions for
    an output of 25", over-reserving the output by at most 2x); the buddy allocator then rounds the
    whole reservation up again."""

    def _reserve(self, request: Request) -> int:
        output = final_length(request, self.max_model_len) - request.num_prompt_tokens
        return request.num_prompt_tokens + (1 << max(output - 1, 0).bit_length())


class OracleReservation(_UpFront):
    """Orca (Oracle): exactly prompt + true output length, known only when EOS cannot cut it short."""

    needs_output_lengths = True

    def _reserve(self, request: Request) -> int:
        return final_length(request, self.max_model_len)

    def rejection(self, request: Request) -> str | None:
        if not request.params.ignore_eos:
            return (
                "orca-oracle reserves prompt + true output length, which is unknown when EOS can end "
                "the request early; submit it with ignore_eos=True"
            )
        return None
