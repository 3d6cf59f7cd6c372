"""Radix tree over token ids -> KV slot indices, shared across requests."""
from radixlang.radix_cache.radix_cache import MatchResult, RadixCache, TreeNode

__all__ = ["MatchResult", "RadixCache", "TreeNode"]
