"""The KV block layer: allocators hand out block ids, the BlockManager maps sequences onto them."""

from paged.memory.allocator import BlockAllocator, NoFreeBlocksError
from paged.memory.block_manager import AllocStatus, BlockManager
from paged.memory.buddy import BuddyAllocator
from paged.memory.naive import NaiveAllocator
from paged.memory.prefix import PrefixCachingAllocator
from paged.memory.reservation import (
    ExactReservation,
    MaxReservation,
    OracleReservation,
    Pow2Reservation,
    Reservation,
)

__all__ = [
    "AllocStatus",
    "BlockAllocator",
    "BlockManager",
    "BuddyAllocator",
    "ExactReservation",
    "MaxReservation",
    "NaiveAllocator",
    "NoFreeBlocksError",
    "OracleReservation",
    "Pow2Reservation",
    "PrefixCachingAllocator",
    "Reservation",
]
