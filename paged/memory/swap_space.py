"""The swap space: a CPU block pool that swap preemption parks sequences' KV in, and the tables of
the sequences parked there (vLLM V0's `swap_out` / `swap_in`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from paged.memory.allocator import BlockAllocator
from paged.memory.naive import NaiveAllocator
from paged.request import Sequence

# (device block, CPU block) on the way out, (CPU block, device block) on the way back
BlockPairs = list[tuple[int, int]]


@dataclass(slots=True)
class Parked:
    """A swapped-out sequence's block table."""

    stale: list[int]  # the table's dropped leading entries, kept so logical block indices stay put
    cpu_blocks: list[int]  # CPU copies of the table's live, filled blocks after them


class SwapSpace:
    """Moves sequences' filled blocks between the device pool and a CPU pool.

    One request's sequences move together and keep what they share shared: a device block several
    of them hold gets one CPU copy, and comes back as one device block where none of them writes it
    next step. Without CPU blocks (`num_blocks=0`) nothing can be swapped out.
    """

    def __init__(self, device: BlockAllocator, num_blocks: int) -> None:
        self.device = device
        self.block_size = device.block_size
        self.allocator = NaiveAllocator(num_blocks, device.block_size) if num_blocks else None
        self.parked: dict[int, Parked] = {}

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self.parked

    def can_swap_out(self, filled: Iterable[list[int]]) -> bool:
        """Whether the CPU pool can take these lists of filled device blocks now (a block in
        several lists moves once)."""
        if self.allocator is None:
            return False
        return len(_distinct(filled)) <= self.allocator.num_free_blocks

    def swap_out(self, tables: dict[int, tuple[list[int], list[int]]]) -> BlockPairs:
        """Park sequences, given by id as (stale leading entries, filled device blocks); returns the
        (device block, CPU block) pairs to copy before the step. The caller checked `can_swap_out`
        and frees the device blocks."""
        cpu = self.allocator
        assert cpu is not None
        moved = _distinct(filled for _, filled in tables.values())
        to_cpu = dict(zip(moved, cpu.allocate_blocks(len(moved)), strict=True))
        for seq_id, (stale, filled) in tables.items():
            cpu_blocks = [to_cpu[b] for b in filled]
            for block_id in cpu_blocks:
                cpu.incref(block_id)
            self.parked[seq_id] = Parked(stale, cpu_blocks)
        # every holder took its own reference above: drop the one allocation gave
        for block_id in to_cpu.values():
            cpu.free(block_id)
        return list(to_cpu.items())

    def num_swap_in_blocks(self, seqs: tuple[Sequence, ...], table_blocks: Callable[[Sequence], int]) -> int:
        """Device blocks `seqs` need to come back with tables of `table_blocks(seq)` entries: each
        shared CPU block once, each block a next step writes once per sequence, plus the entries
        past the parked ones (what a reservation covers beyond the tokens)."""
        shared: set[int] = set()
        num_blocks = 0
        for s in seqs:
            parked = self.parked[s.seq_id]
            first_written = self._first_written(s)
            shared.update(parked.cpu_blocks[:first_written])
            num_blocks += table_blocks(s) - len(parked.stale) - min(first_written, len(parked.cpu_blocks))
        return len(shared) + num_blocks

    def swap_in(
        self, seqs: tuple[Sequence, ...], table_blocks: Callable[[Sequence], int]
    ) -> tuple[list[tuple[list[int], int]], BlockPairs]:
        """Bring `seqs` back into device tables of `table_blocks(seq)` entries, sharing again what
        they shared and will only read. Returns each table with its number of stale leading entries,
        and the (CPU block, device block) pairs to copy before the step (a CPU block may go to
        several device blocks). The caller checked the device has room."""
        cpu = self.allocator
        assert cpu is not None
        # one allocation, so a contiguous allocator gives a lone sequence one extent
        fresh = iter(self.device.allocate_blocks(self.num_swap_in_blocks(seqs, table_blocks)))
        to_device: dict[int, int] = {}
        tables: list[tuple[list[int], int]] = []
        pairs: BlockPairs = []
        for seq in seqs:
            first_written = self._first_written(seq)
            parked = self.parked.pop(seq.seq_id)
            table = list(parked.stale)
            for i, block_id in enumerate(parked.cpu_blocks):
                device = to_device.get(block_id) if i < first_written else None
                if device is None:
                    device = next(fresh)
                    pairs.append((block_id, device))
                    if i < first_written:
                        to_device[block_id] = device
                else:
                    self.device.incref(device)
                table.append(device)
                cpu.free(block_id)
            table.extend(next(fresh) for _ in range(table_blocks(seq) - len(table)))
            tables.append((table, len(parked.stale)))
        return tables, pairs

    def free(self, seq: Sequence) -> bool:
        """Drop `seq`'s CPU copies if it is parked here; whether it was."""
        parked = self.parked.pop(seq.seq_id, None)
        if parked is None:
            return False
        assert self.allocator is not None
        for block_id in parked.cpu_blocks:
            self.allocator.free(block_id)
        return True

    def _first_written(self, seq: Sequence) -> int:
        """Index, among `seq`'s parked blocks, of the first one its next step writes: from there on
        each sequence gets its own device copy, so nothing shared is written."""
        return seq.num_computed_tokens // self.block_size - len(self.parked[seq.seq_id].stale)


def _distinct(block_lists: Iterable[list[int]]) -> list[int]:
    return list(dict.fromkeys(b for blocks in block_lists for b in blocks))
