"""The disk tier for evicted prefix blocks on the simulator (`paged.memory.kv_tiers.TierStore`): no
bytes, only the time the disk takes, at `hardware.disk_bandwidth`.

The disk is one queue. Writes (spills) run in the background as the real executor's writer thread
does: they occupy the disk while steps compute. A read (a disk hit) is synchronous, done while the
step is scheduled: it waits for the writes queued before it, then reads, and the step waits for both.
Files never go missing or bad here, so every read hits.
"""

from __future__ import annotations


class SimTierDisk:
    def __init__(self, bytes_per_block: int, disk_bandwidth: float) -> None:
        self.seconds_per_block = bytes_per_block / disk_bandwidth
        self._backlog_s = 0.0  # queued writes not yet on disk at the start of the next step
        self._writes = self._reads = 0  # blocks since the last step was priced

    def spill(self, host_block: int, block_hash: bytes, disk_slot: int) -> None:
        self._writes += 1

    def load(self, disk_slot: int, block_hash: bytes, host_block: int) -> bool:
        self._reads += 1
        return True

    def discard(self, disk_slot: int) -> None:
        """Nothing to delete."""

    def write_error(self) -> None:
        return None

    def close(self) -> None:
        """Nothing to remove."""

    def stall_s(self, compute_s: float) -> float:
        """Seconds the step waits on the disk before it computes for `compute_s`: its reads and the
        writes queued before them. The writes of this step then drain while it computes."""
        stall = 0.0
        if self._reads:
            stall = self._backlog_s + self._reads * self.seconds_per_block
            self._backlog_s = 0.0
        self._backlog_s = max(0.0, self._backlog_s + self._writes * self.seconds_per_block - compute_s)
        self._writes = self._reads = 0
        return stall
