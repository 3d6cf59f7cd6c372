"""KV bookkeeping over an ``SWATokenToKVPool``: window layers keep KV only for tokens a query can still see.

A query at position i sees window keys i - window + 1 .. i (window: the pool's longest). A running request
with ``kv_len`` tokens in the pool asks its next queries from position kv_len on, so after each step
``trim_window`` frees the window KV of its own tokens before kv_len - window + 1 (``swa_freed_len`` marks
how far); tokens the prefix tree holds lose theirs only through the tree (``SWARadixCache.evict_swa``),
which keeps, under each request's lock, the last window - 1 tokens of the prefix it runs on until the
request's next queries no longer see them: ``trim_window`` then drops the window part of the lock
(``swa_window_released``), and the full part stays until the request unlocks. A token without window KV
keeps its full-attention KV until its full slot is freed.

Room is counted in both slot spaces: a token to compute needs one slot of each.
"""
from __future__ import annotations

import torch

from radixlang.radix_cache import SWARadixCache, TreeNode
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool
from radixlang.runtime.mem_cache.req_cache import CachedReq, NoReqCache
from radixlang.runtime.mem_cache.swa_memory_pool import SWATokenToKVPool
from radixlang.runtime.mem_cache.tree_req_cache import TreeReqCache


def _trim(req: CachedReq, pool: SWATokenToKVPool, row: torch.Tensor, own_start: int) -> None:
    """Free the window KV of the request's own tokens (from own_start) that its next queries cannot see."""
    start = max(own_start, req.swa_freed_len)
    end = req.kv_len - pool.window + 1
    if end > start:
        pool.free_swa(row[start:end].to(torch.int64))
        req.swa_freed_len = end


class SWANoReqCache(NoReqCache):
    """--disable-radix-cache over an swa pool: a request owns all its tokens, so it trims them all."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: SWATokenToKVPool) -> None:
        super().__init__(req_to_token_pool, kv_pool)
        self.swa_pool = kv_pool

    def room(self) -> int:
        return min(self.swa_pool.available_size(), self.swa_pool.swa_available_size())

    def trim_window(self, req: CachedReq) -> None:
        if req.req_pool_idx is not None:
            _trim(req, self.swa_pool, self.req_to_token_pool.req_to_token[req.req_pool_idx], 0)


class SWATreeReqCache(TreeReqCache):
    """The radix tree over an swa pool (``SWARadixCache``): tombstoned prefixes, window locks, swa eviction."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: SWATokenToKVPool, *, page_size: int = 1) -> None:
        self.swa_tree = SWARadixCache(kv_pool.window, page_size=page_size)
        super().__init__(req_to_token_pool, kv_pool, tree=self.swa_tree)
        self.swa_pool = kv_pool

    def _insert(self, req: CachedReq, tokens: list[int], kv: torch.Tensor) -> int:
        # the request's own tokens from swa_from on keep window KV: a tombstone there takes it over
        swa_from = max(int(req.prefix_indices.numel()), req.swa_freed_len)
        return self.swa_tree.insert(tokens, kv, req.cache_namespace, swa_from=swa_from,
                                    revive_fn=self.swa_pool.move_swa)

    def _match_inserted(self, req: CachedReq, tokens: list[int]) -> tuple[torch.Tensor, TreeNode]:
        # the request's window is live there (its own or revived KV), whatever lies further back
        return self.swa_tree.match_through_tombstones(tokens, req.cache_namespace)

    def trim_window(self, req: CachedReq) -> None:
        if req.req_pool_idx is None:
            return
        prefix = int(req.prefix_indices.numel())
        _trim(req, self.swa_pool, self.req_to_token_pool.req_to_token[req.req_pool_idx], prefix)
        if (req.last_node is not None and not req.swa_window_released
                and req.kv_len - self.swa_pool.window + 1 >= prefix):  # its next queries see none of the prefix
            self.swa_tree.release_window(req.last_node)
            req.swa_window_released = True

    def unlock(self, req: CachedReq) -> None:
        if req.last_node is not None:
            self.swa_tree.dec_lock_ref(req.last_node, window=not req.swa_window_released)

    def cache_unfinished(self, req: CachedReq) -> None:
        super().cache_unfinished(req)  # unlocks the old node as it was held, locks the new one whole
        req.swa_window_released = False

    def room(self) -> int:
        return min(self.swa_pool.available_size() + self.tree.evictable_size(),
                   self.swa_pool.swa_available_size() + self.swa_tree.swa_evictable_size())

    def make_room(self, num_tokens: int) -> None:
        super().make_room(num_tokens)  # evicted leaves free their window KV too
        short = num_tokens - self.swa_pool.swa_available_size()
        if short > 0:
            self.swa_tree.evict_swa(short, self.swa_pool.free_swa, self.swa_pool.free)

    def swa_cached_size(self) -> int:
        return self.swa_tree.swa_evictable_size() + self.swa_tree.swa_protected_size()
