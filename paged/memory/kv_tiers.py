"""Tiers for evicted prefix blocks (`allocator.offload`): a cached block the device evicts is kept
in host memory, and a host block the CPU tier evicts on disk, so a later prefix hit found there is
brought back by copy instead of recomputed (LMCache, SGLang's HiCache, vLLM's offloading connector).

The device's allocator calls `offload` with each cached block it evicts, before the block is handed
out again; prefix lookups continue along a sequence's hash chain into the tiers where the device
misses (`holds`), and admission brings those blocks back into fresh device blocks (`hold`, then
`onload`). Tiers are inclusive: a block brought back stays in its tier, so evicting it from the
device again copies nothing. The device <-> host copies are recorded here and handed to the
executor with the step (`take_moves`: offloads run first, onloads last, before the step writes any
KV). Disk I/O goes through a `TierStore`, the executor's side: a spill snapshots a host block now
and writes its file in the background; a disk hit reads the file back into a host slot and verifies
it there, so a missing or corrupt file is a miss (the chain stops), never wrong KV. A disk that
fails a write (full: ENOSPC) turns the disk tier off with one warning; nothing else is lost.
"""

from __future__ import annotations

import logging
from typing import Protocol

from paged.memory.tier_pool import Evicted, TierPool

log = logging.getLogger(__name__)

BlockPairs = list[tuple[int, int]]


class TierStore(Protocol):
    """The disk tier's bytes, kept by the executor. Host blocks are ids in the executor's host pool."""

    def spill(self, host_block: int, block_hash: bytes, disk_slot: int) -> None:
        """Snapshot `host_block` now and write it as `disk_slot`'s file (in the background)."""

    def load(self, disk_slot: int, block_hash: bytes, host_block: int) -> bool:
        """Read `disk_slot`'s file into `host_block` if it holds `block_hash`'s bytes intact; False
        (and `host_block` untouched) if the file is missing or corrupt."""

    def discard(self, disk_slot: int) -> None:
        """`disk_slot`'s file is no longer wanted."""

    def write_error(self) -> OSError | None:
        """The error a background write failed with, if one did."""

    def close(self) -> None:
        """Stop writing and remove the files."""


class KVTiers:
    """The CPU tier (`cpu`) and an optional disk tier (`disk`, with its `store`) below the device.

    CPU slot `s` is host block `host_offset + s` of the executor's host pool (the swap pool takes
    the blocks before it). Counters are cumulative: blocks each tier served as prefix hits, blocks
    copied each way and to or from disk, and disk blocks found missing or corrupt.
    """

    def __init__(self, cpu: TierPool, host_offset: int = 0, disk: TierPool | None = None,
                 store: TierStore | None = None) -> None:
        if (disk is None) != (store is None):
            raise ValueError("a disk tier needs a store, and a store a disk tier")
        self.cpu, self.disk, self.store = cpu, disk, store
        self.host_offset = host_offset
        self._offloads: BlockPairs = []
        self._onloads: BlockPairs = []
        self.hit_blocks = {"cpu": 0, "disk": 0}
        self.num_offloads = self.num_onloads = 0
        self.num_disk_writes = self.num_disk_reads = self.num_disk_bad = 0

    # -- the device's side ---------------------------------------------------------------------------

    def offload(self, device_block: int, block_hash: bytes, position: int) -> None:
        """The device evicts `device_block`, cached under `block_hash` at `position` in its chain:
        copy it to the CPU tier (unless it holds the block already), spilling the CPU tier's victim
        to disk. Every CPU entry pinned this step: the block is lost, as without tiers."""
        self._check_disk()
        slot = self.cpu.slot(block_hash)
        if slot is not None:
            self.cpu.touch(slot)
            return
        added = self.cpu.add(block_hash, position)
        if added is None:
            return
        slot, evicted = added
        if evicted is not None:
            self._spill(evicted)
        self._offloads.append((device_block, self.host_offset + slot))
        self.num_offloads += 1

    def holds(self, block_hash: bytes) -> bool:
        """Whether a tier holds `block_hash` (what a lookup sees; a disk file is verified on use)."""
        disk = self.disk
        return self.cpu.slot(block_hash) is not None or (disk is not None and disk.slot(block_hash) is not None)

    def hold(self, chain: list[bytes]) -> int:
        """Pin the leading blocks of `chain` that a tier holds, so the evictions of the allocation
        that follows keep them; returns how many."""
        self._check_disk()
        held = 0
        for block_hash in chain:
            slot = self.cpu.slot(block_hash)
            if slot is not None:
                self.cpu.pin(slot)
            elif self.disk is not None and (slot := self.disk.slot(block_hash)) is not None:
                self.disk.pin(slot)
            else:
                break
            held += 1
        return held

    def onload(self, block_hash: bytes, device_block: int) -> str | None:
        """Bring `block_hash`'s block into `device_block` (a fresh block): a copy from its CPU slot,
        after reading it from disk into one when only the disk tier holds it. Returns the tier that
        served it, or None (nothing recorded) when it is gone, its file is missing or corrupt, or
        the CPU tier has no slot to land it in."""
        slot = self.cpu.slot(block_hash)
        tier = "cpu"
        if slot is None:
            slot = self._read_disk(block_hash)
            tier = "disk"
            if slot is None:
                return None
        else:
            self.cpu.pin(slot)
        self._onloads.append((self.host_offset + slot, device_block))
        self.num_onloads += 1
        self.hit_blocks[tier] += 1
        return tier

    def take_moves(self) -> tuple[BlockPairs, BlockPairs]:
        """The step's (device block, host block) offloads and (host block, device block) onloads;
        the entries they pinned become evictable again."""
        self._check_disk()
        moves = self._offloads, self._onloads
        self._offloads, self._onloads = [], []
        self.cpu.unpin_all()
        if self.disk is not None:
            self.disk.unpin_all()
        return moves

    def counts(self, block_size: int) -> dict[str, int]:
        """The counters, as `KVStats` names them (hits in tokens of `block_size`-token blocks)."""
        return {
            "num_hit_tokens_cpu": self.hit_blocks["cpu"] * block_size,
            "num_hit_tokens_disk": self.hit_blocks["disk"] * block_size,
            "num_offload_blocks": self.num_offloads,
            "num_onload_blocks": self.num_onloads,
            "num_disk_write_blocks": self.num_disk_writes,
            "num_disk_read_blocks": self.num_disk_reads,
            "num_disk_bad_blocks": self.num_disk_bad,
        }

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    # -- disk ------------------------------------------------------------------------------------------

    def _spill(self, evicted: Evicted) -> None:
        """The CPU tier evicted `evicted`: write it to the disk tier unless that holds it already."""
        slot, block_hash, position = evicted
        disk = self.disk
        if disk is None:
            return
        assert self.store is not None
        disk_slot = disk.slot(block_hash)
        if disk_slot is not None:
            disk.touch(disk_slot)
            return
        added = disk.add(block_hash, position)
        if added is None:
            return
        # a disk victim's file is simply overwritten by this one
        self.store.spill(self.host_offset + slot, block_hash, added[0])
        self.num_disk_writes += 1

    def _read_disk(self, block_hash: bytes) -> int | None:
        """Read `block_hash`'s file into a CPU slot (pinned); None on a miss or a bad file."""
        disk = self.disk
        disk_slot = disk.slot(block_hash) if disk is not None else None
        if disk_slot is None:
            return None
        assert disk is not None and self.store is not None
        disk.pin(disk_slot)  # kept through the spill that landing it in the CPU tier may cause
        added = self.cpu.add(block_hash, disk.position(disk_slot))
        if added is None:
            return None
        slot, evicted = added
        if evicted is not None:
            self._spill(evicted)
        if not self.store.load(disk_slot, block_hash, self.host_offset + slot):
            self.cpu.drop(slot)
            disk.drop(disk_slot)
            self.store.discard(disk_slot)
            self.num_disk_bad += 1
            return None
        self.num_disk_reads += 1
        return slot

    def _check_disk(self) -> None:
        """Turn the disk tier off, with one warning, once a background write has failed."""
        if self.store is None or self.disk is None:
            return
        error = self.store.write_error()
        if error is None:
            return
        log.warning("allocator.offload: the disk tier is off for the rest of the run: a write failed (%s); the "
                    "device and CPU tiers keep what they hold", error)
        self.disk = None
        self.store.close()
