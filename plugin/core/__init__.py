"""Engine-free core: the hybrid radix tree, its LRU lists, the allocator boundary and statistics."""

from hybrid_prefix_cache.core.allocator import SlotAllocator
from hybrid_prefix_cache.core.stats import CacheStats
from hybrid_prefix_cache.core.tree import (
    EvictionPolicy,
    EvictResult,
    HybridRadixTree,
    InsertResult,
    LRUEviction,
    MatchResult,
    Node,
    PathLock,
    TreeError,
)

__all__ = [
    "CacheStats",
    "EvictResult",
    "EvictionPolicy",
    "HybridRadixTree",
    "InsertResult",
    "LRUEviction",
    "MatchResult",
    "Node",
    "PathLock",
    "SlotAllocator",
    "TreeError",
]
