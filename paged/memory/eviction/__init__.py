"""Eviction policies for cached prefix blocks: a small base (`EvictionPolicy`) and one file per policy."""

from paged.memory.eviction.arc import ARCPolicy
from paged.memory.eviction.cost import CostPolicy
from paged.memory.eviction.eviction_policy import EvictionPolicy
from paged.memory.eviction.fifo import FIFOPolicy
from paged.memory.eviction.lfu import LFUPolicy
from paged.memory.eviction.lru import LRUPolicy
from paged.memory.eviction.s3fifo import S3FIFOPolicy

# the built-in policies by their config name (`allocator/eviction=<name>`)
POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, FIFOPolicy, S3FIFOPolicy, ARCPolicy, CostPolicy)
}

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "CostPolicy",
    "EvictionPolicy",
    "FIFOPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
]
