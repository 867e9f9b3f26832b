"""The disk tier's files for evicted prefix blocks (`paged.memory.kv_tiers.TierStore`), on the real
executor: one file per disk slot holding a host block's bytes in every layer's K and V.

A spill copies the host block into memory at once (the host slot is reused as soon as the step's
copies run) and a background thread writes the file, so the engine never waits on the disk to evict.
A file starts with a header: a magic, the block's hash, the payload's length and its xxh3-64
checksum. A read checks all four before it writes a byte into the host pool: a missing, truncated or
corrupt file (or one holding another block) is a miss, never wrong KV. A write that fails (a full
disk) is kept for `write_error`; the writer then drops what is queued. The files live in a folder of
their own, removed when the store closes, is collected, or the process exits.
"""

from __future__ import annotations

import queue
import shutil
import struct
import tempfile
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from paged.memory.kv_tiers import TierStore

MAGIC = b"pagedKV1"
_HEADER = struct.Struct("<8s16sQQ")  # magic, block hash (xxh3-128), payload bytes, payload xxh3-64


def write_file(path: Path, data: bytes) -> None:
    """Write one slot's file (the writer thread's only disk write)."""
    with open(path, "wb") as f:
        f.write(data)


class TierFiles:
    """A `TierStore` over the host blocks `host_caches()` returns (every layer's K and V tensor of
    the host pool, in one order) on a `device` whose copies into them may still be in flight."""

    def __init__(self, host_caches: Callable[[], list[torch.Tensor]], device: torch.device, directory: str) -> None:
        self._host_caches = host_caches
        self._device = device
        self.folder = Path(tempfile.mkdtemp(prefix="paged-kv-tier-", dir=directory))
        self._pending: dict[int, bytes] = {}  # disk slot -> file content not yet written
        self._lock = threading.Lock()
        self._error: list[OSError] = []
        self._queue: queue.Queue[tuple[int, bytes | None] | None] = queue.Queue()
        self._thread = threading.Thread(
            target=_write_files, args=(self._queue, self.folder, self._pending, self._lock, self._error),
            name="paged-kv-tier-writer", daemon=True,
        )
        self._thread.start()
        self._close = weakref.finalize(self, _shut, self._queue, self._thread, self.folder)

    def path(self, disk_slot: int) -> Path:
        return self.folder / f"{disk_slot}.kv"

    def spill(self, host_block: int, block_hash: bytes, disk_slot: int) -> None:
        self._settle()
        payload = torch.cat([_bytes_of(t[host_block]) for t in self._host_caches()]).numpy().tobytes()
        data = _HEADER.pack(MAGIC, block_hash, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload
        with self._lock:
            self._pending[disk_slot] = data
        self._queue.put((disk_slot, data))

    def load(self, disk_slot: int, block_hash: bytes, host_block: int) -> bool:
        with self._lock:
            data = self._pending.get(disk_slot)
        if data is None:
            try:
                data = self.path(disk_slot).read_bytes()
            except OSError:
                return False
        targets = [_bytes_of(t[host_block]) for t in self._host_caches()]
        payload = _verified(data, block_hash, sum(t.numel() for t in targets))
        if payload is None:
            return False
        self._settle()
        source = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for target in targets:
            target.copy_(source[offset : offset + target.numel()])
            offset += target.numel()
        return True

    def discard(self, disk_slot: int) -> None:
        with self._lock:
            self._pending.pop(disk_slot, None)
        self._queue.put((disk_slot, None))

    def write_error(self) -> OSError | None:
        return self._error[0] if self._error else None

    def close(self) -> None:
        self._close()

    def flush(self) -> None:
        """Wait until every spill so far is on disk (or failed)."""
        self._queue.join()

    def _settle(self) -> None:
        """Wait for the device's copies into (or out of) the host pool, which run asynchronously on CUDA."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)


def _bytes_of(block: torch.Tensor) -> torch.Tensor:
    """A host block's bytes as a flat uint8 view (a block of a contiguous pool is contiguous)."""
    return block.view(torch.uint8).reshape(-1)


def _verified(data: bytes, block_hash: bytes, num_bytes: int) -> memoryview | None:
    """The payload of a slot file that holds `block_hash`'s `num_bytes` bytes intact, else None."""
    if len(data) != _HEADER.size + num_bytes:
        return None
    magic, stored_hash, length, checksum = _HEADER.unpack_from(data)
    payload = memoryview(data)[_HEADER.size :]
    if magic != MAGIC or stored_hash != block_hash or length != num_bytes:
        return None
    return payload if xxhash.xxh3_64_intdigest(payload) == checksum else None


def _write_files(
    jobs: queue.Queue[Any], folder: Path, pending: dict[int, bytes], lock: threading.Lock, error: list[OSError]
) -> None:
    """The writer thread: write (or, for None, delete) slot files in order until told to stop; after
    a failed write it writes nothing more (the disk tier is turned off)."""
    while (job := jobs.get()) is not None:
        disk_slot, data = job
        path = folder / f"{disk_slot}.kv"
        try:
            if error:
                continue
            if data is None:
                path.unlink(missing_ok=True)
            else:
                write_file(path, data)
        except OSError as e:
            error.append(e)
        finally:
            with lock:
                if data is not None and pending.get(disk_slot) is data:
                    del pending[disk_slot]
            jobs.task_done()
    jobs.task_done()  # the stop job: a later `flush` returns at once


def _shut(jobs: queue.Queue[Any], thread: threading.Thread, folder: Path) -> None:
    jobs.put(None)
    thread.join(timeout=10.0)
    shutil.rmtree(folder, ignore_errors=True)


class TieredHostPool:
    """The real executor's part in `allocator.offload`: its host pool (`cpu_key_caches`,
    `cpu_value_caches`) also holds the CPU tier's blocks, and files of them are the disk tier."""

    supports_kv_tiers = True
    cpu_key_caches: list[torch.Tensor]
    cpu_value_caches: list[torch.Tensor]
    device: torch.device

    def kv_tier_store(self, directory: str) -> TierStore:
        """The disk tier's files, in a folder of this run's own under `directory`."""
        return TierFiles(lambda: [*self.cpu_key_caches, *self.cpu_value_caches], self.device, directory)
