"""The block allocator protocol: hands out physical KV block ids and counts references to them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar


class NoFreeBlocksError(RuntimeError):
    """The pool is exhausted; callers should have asked `can_allocate` / `can_append_slots` first."""


class BlockAllocator(ABC):
    """Owns block ids `0..num_blocks-1` and their refcounts.

    Config names an allocator by import path and builds it as `cls(num_blocks=..., block_size=...)`,
    so subclasses keep that constructor. Only `allocate`, `incref`, `free`, `refcount` and
    `num_free_blocks` are required; the prefix-cache hooks default to "no cache".
    """

    caches_prefixes: ClassVar[bool] = False
    # cached blocks evicted so far (an allocator with a prefix cache counts them; others evict none)
    num_evictions: int = 0
    # A sequence's blocks are one contiguous extent handed out at admission (Orca-style): growth past
    # it, and sharing blocks between the samples of a request, are refused.
    contiguous: ClassVar[bool] = False
    # Swap preemption moves a sequence's KV to the CPU pool and later rebuilds its table with
    # `allocate_blocks`; an allocator opts in once its placement survives that round trip.
    supports_swap: ClassVar[bool] = False

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size

    @abstractmethod
    def allocate(self) -> int:
        """A block id with refcount 1; `NoFreeBlocksError` when none is free."""

    @abstractmethod
    def incref(self, block_id: int) -> None:
        """One more reference to a block that is already referenced."""

    @abstractmethod
    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes allocatable again. Double free raises."""

    @abstractmethod
    def refcount(self, block_id: int) -> int: ...

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now, evictable cached blocks included."""

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """`num_blocks` block ids with refcount 1, all or none; `NoFreeBlocksError` when they do not fit."""
        if not self.can_allocate_blocks(num_blocks):
            raise NoFreeBlocksError(f"{num_blocks} blocks requested, {self.num_free_blocks} are free")
        return [self.allocate() for _ in range(num_blocks)]

    def can_allocate_blocks(self, num_blocks: int) -> bool:
        """Whether `allocate_blocks(num_blocks)` succeeds now."""
        return num_blocks <= self.num_free_blocks

    @property
    def max_allocation(self) -> int:
        """The most blocks one `allocate_blocks` call can ever get (an empty pool's largest extent)."""
        return self.num_blocks

    @property
    def num_unassigned_blocks(self) -> int:
        """Blocks taken from the free pool that no block id handed out stands for (a buddy
        allocator's rounding to a power of two): the allocator's own external fragmentation."""
        return 0

    def num_stranded_free_blocks(self, num_blocks: int) -> int:
        """Free blocks that an `allocate_blocks(num_blocks)` call could not use, however many are
        free: external fragmentation as a waiting request sees it. None for a block-granular pool."""
        return 0

    @property
    def num_cached_free_blocks(self) -> int:
        """Unreferenced blocks that still hold a cached prefix."""
        return 0

    def match(self, block_hash: bytes) -> int | None:
        """The block cached under `block_hash`, with one more reference taken on it; None on a miss."""
        return None

    def peek(self, block_hash: bytes) -> int | None:
        """Like `match` but touches nothing: admission control asks before it commits."""
        return None

    def insert(self, block_id: int, block_hash: bytes, position: int = 0) -> None:
        """Publish a full, computed block under its content hash, `position` blocks deep in its hash
        chain (what an eviction policy ranks by); allocators without a cache ignore it."""
        return None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`: after a weight update, or so a
        benchmark starts cold). Only possible while no block is referenced; returns whether it ran."""
        return self.num_free_blocks == self.num_blocks


def plain_blocks(allocator: BlockAllocator) -> bool:
    """Whether `allocator` keeps the base class's `allocate_blocks` and `can_allocate_blocks`: then
    `allocate_blocks(1)`, once `num_free_blocks` is positive, is `[allocate()]`. A proxy that passes
    calls on (a KV group's view of a shared pool) does not say so."""
    cls = type(allocator)
    return (getattr(cls, "allocate_blocks", None) is BlockAllocator.allocate_blocks
            and getattr(cls, "can_allocate_blocks", None) is BlockAllocator.can_allocate_blocks)


class RefCountedAllocator(BlockAllocator):
    """Reference counting shared by the built-in allocators; subclasses say where a block goes
    when its last reference is dropped (`_release`)."""

    supports_swap = True

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._refcounts = [0] * num_blocks

    def incref(self, block_id: int) -> None:
        assert self._refcounts[block_id] > 0, f"incref of free block {block_id}"
        self._refcounts[block_id] += 1

    def free(self, block_id: int) -> None:
        count = self._refcounts[block_id]
        if count <= 0:
            raise RuntimeError(f"double free of block {block_id}")
        self._refcounts[block_id] = count - 1
        if count == 1:
            self._release(block_id)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    @abstractmethod
    def _release(self, block_id: int) -> None:
        """`block_id` just lost its last reference."""
