"""The slot ledger: token slots per physical KV block, the memory breakdown's raw numbers.

Of an allocated block's slots, some hold a token's KV (used), some are empty but their sequence will
still fill them (reserved: what an up-front reservation costs until it is used), and the rest are
internal fragmentation (`KVStats` derives it from the two totals kept here).
"""

from __future__ import annotations

from collections.abc import Iterable


class SlotLedger:
    """Filled and still-to-fill slots of every block, and their totals.

    A shared block is never written (copy-on-write first), so every sequence referencing it agrees
    on its fill: keeping one count per block counts each token state once, however many tables hold it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._fill = [0] * num_blocks
        # Per block, the empty slots its sequence will still fill (the same bookkeeping as `_fill`).
        self._future = [0] * num_blocks
        self.num_used = 0
        self.num_reserved = 0

    def account(self, block_id: int, fill: int, cap: int) -> None:
        """Set a block's filled slots, and its reserved ones: the empty slots among the `cap` that
        its sequence will fill."""
        future = max(cap - fill, 0)
        self.num_used += fill - self._fill[block_id]
        self.num_reserved += future - self._future[block_id]
        self._fill[block_id] = fill
        self._future[block_id] = future

    def account_table(self, table: list[int], indices: Iterable[int], num_tokens: int, final: int) -> None:
        """`account` the table's blocks at `indices` for a sequence of `num_tokens` filling `final` slots
        (inlined: the totals' integer changes summed, each block's books set as `account` sets them)."""
        bs, fills, futures = self.block_size, self._fill, self._future
        used = reserved = 0
        for i in indices:
            block_id, start = table[i], i * bs
            fill = min(bs, max(num_tokens - start, 0))
            future = max(min(max(final - start, 0), bs) - fill, 0)  # `_cap(i, final)` less the filled
            used += fill - fills[block_id]
            reserved += future - futures[block_id]
            fills[block_id], futures[block_id] = fill, future
        self.num_used += used
        self.num_reserved += reserved

    def open_block(self, block_id: int, index: int, final: int) -> None:
        """`account_table` of a freshly allocated `index`-th block whose first slot a sequence filling
        `final` slots just filled (a decode step at a block's edge)."""
        self.account(block_id, 1, self._cap(index, final))

    def append_token(self, block_id: int) -> None:
        """One more slot of `block_id` filled: the common decode step, kept cheap."""
        self._fill[block_id] += 1
        self.num_used += 1
        if self._future[block_id]:
            self._future[block_id] -= 1
            self.num_reserved -= 1

    def append_each(self, block_ids: list[int]) -> None:
        """`append_token` for each of `block_ids` (distinct blocks): a steady decode step's batch."""
        fill, future = self._fill, self._future
        reserved = 0
        for block_id in block_ids:
            fill[block_id] += 1
            if future[block_id]:
                future[block_id] -= 1
                reserved += 1
        self.num_used += len(block_ids)
        self.num_reserved -= reserved

    def append_tokens(self, block_id: int, count: int) -> int:
        """`count` more slots of `block_id` filled, as `count` calls of `append_token` leave it (a
        fast-forward window's run of steps off a block's edge); returns how many of them were
        reserved, which are the first ones."""
        self._fill[block_id] += count
        self.num_used += count
        reserved = min(self._future[block_id], count)
        self._future[block_id] -= reserved
        self.num_reserved -= reserved
        return reserved

    def copy(self, src: int, dst: int, index: int, final: int) -> None:
        """`dst` became a private copy of `src`, the `index`-th block of a sequence filling `final` slots."""
        self.account(dst, self._fill[src], self._cap(index, final))

    def clear(self, block_id: int) -> None:
        """Nobody holds `block_id` any more: it has no token states left (`account(block_id, 0, 0)`)."""
        fill, future = self._fill, self._future
        self.num_used -= fill[block_id]
        self.num_reserved -= future[block_id]
        fill[block_id] = future[block_id] = 0

    def _cap(self, index: int, final: int) -> int:
        """Slots of a table's `index`-th block that a sequence filling `final` slots uses."""
        return min(max(final - index * self.block_size, 0), self.block_size)
