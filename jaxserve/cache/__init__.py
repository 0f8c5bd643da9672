"""Host-side cache bookkeeping: page / slot allocators and the hybrid radix prefix cache.

Pure Python over integer ids; the device pools they index live in the runner. See README.md here.
"""

from .allocator import PageAllocator, SlotAllocator
from .radix import CacheStats, HybridRadixCache, Match, Node

__all__ = ["CacheStats", "HybridRadixCache", "Match", "Node", "PageAllocator", "SlotAllocator"]
