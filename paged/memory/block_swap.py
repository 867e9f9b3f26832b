"""`BlockManager`'s swap to a CPU pool (its base class): a preempted request's filled blocks move to
`SwapSpace` and come back with what they shared shared again."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged.memory.allocator import NoFreeBlocksError
from paged.memory.seq_blocks import AllocStatus, _SeqBlocks
from paged.memory.slot_ledger import SlotLedger
from paged.memory.swap_space import SwapSpace
from paged.request import Sequence

if TYPE_CHECKING:
    from collections.abc import Callable


class SwapMixin:
    """Swap out and in; `BlockManager.__init__` sets the state it uses."""

    swap_space: SwapSpace
    ledger: SlotLedger
    _seqs: dict[int, _SeqBlocks]
    _num_logical_blocks: int
    admission_blocks: Callable[[Sequence], int]
    free: Callable[[Sequence], None]
    _never_fits: Callable[[int], bool]
    _status: Callable[[int, int], AllocStatus]
    _final: Callable[[Sequence], int]
    _cdiv: Callable[[int], int]

    def can_swap_out(self, *seqs: Sequence) -> bool:
        """Whether the CPU pool can take the filled blocks of `seqs` (one request's running sequences) now."""
        return self.swap_space.can_swap_out(self._filled_blocks(self._seqs[s.seq_id]) for s in seqs)

    def swap_out(self, *seqs: Sequence) -> list[tuple[int, int]]:
        """Move the filled blocks of `seqs` to the CPU pool, keeping what they share shared, and free
        their device blocks; returns the (device block, CPU block) pairs to copy before the step."""
        if not self.can_swap_out(*seqs):
            raise NoFreeBlocksError(f"the CPU swap space cannot take sequences {[s.seq_id for s in seqs]}")
        tables: dict[int, tuple[list[int], list[int]]] = {}
        for seq in seqs:
            state = self._seqs[seq.seq_id]
            tables[seq.seq_id] = (state.table[: state.num_dropped], self._filled_blocks(state))
            self.free(seq)  # the executor copies the blocks out before the step that reuses them
        return self.swap_space.swap_out(tables)

    def can_swap_in(self, *seqs: Sequence) -> AllocStatus:
        required = self.swap_space.num_swap_in_blocks(seqs, self.admission_blocks)
        return AllocStatus.NEVER if self._never_fits(required) else self._status(required, required)

    def swap_in(self, *seqs: Sequence) -> list[tuple[int, int]]:
        """Give `seqs` device blocks for all their tokens (and reservations), sharing again what
        they shared and will only read, and bring their KV back; returns the (CPU block, device
        block) pairs to copy before the step runs (a CPU block may go to several device blocks)."""
        if self.can_swap_in(*seqs) is not AllocStatus.OK:
            raise NoFreeBlocksError(f"no room on the device to swap sequences {[s.seq_id for s in seqs]} in")
        tables, pairs = self.swap_space.swap_in(seqs, self.admission_blocks)
        for seq, (table, start) in zip(seqs, tables, strict=True):
            final = self._final(seq)
            self.ledger.account_table(table, range(start, len(table)), seq.num_tokens, final)
            # Swapped-in blocks are published again on the next mark_computed (a duplicate of a
            # block still cached stays unpublished).
            self._seqs[seq.seq_id] = _SeqBlocks(table, seq.num_tokens, final, start, start)
            self._num_logical_blocks += len(table) - start
        return pairs

    def is_swapped(self, seq: Sequence) -> bool:
        return self.swap_space.holds(seq)

    def _filled_blocks(self, state: _SeqBlocks) -> list[int]:
        """The live blocks holding token states: what a swap moves (an empty reservation is not)."""
        return state.table[state.num_dropped : self._cdiv(state.num_slots)]
