"""Radix tree over token ids -> KV slot indices, shared across requests."""
from radixlang.radix_cache.radix_cache import MatchResult, RadixCache, TreeNode
from radixlang.radix_cache.swa_radix_cache import SWARadixCache

__all__ = ["MatchResult", "RadixCache", "SWARadixCache", "TreeNode"]
