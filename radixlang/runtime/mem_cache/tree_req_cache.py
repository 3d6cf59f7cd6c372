"""TreeReqCache: the scheduler's bookkeeping around the radix tree.

A running request's KV row is [prefix owned by the tree (locked) | slots it owns].
``cache_unfinished`` moves its computed tokens into the tree and re-points the
row at the tree's slots; ``release`` frees only the slots the request still owns.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from radixlang.radix_cache import RadixCache, TreeNode
from radixlang.radix_cache.scores import TokenScores
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.mem_cache.req_cache import CachedReq


class TreeReqCache:
    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool, *, page_size: int = 1,
                 tree: RadixCache | None = None) -> None:
        """``tree``: a RadixCache subclass to keep the cache in (default a RadixCache of ``page_size``)."""
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.tree = tree if tree is not None else RadixCache(page_size=page_size)

    def match(self, req: CachedReq, max_len: int) -> tuple[torch.Tensor, TreeNode]:
        kv, node = self.tree.match_prefix(req.fill_ids[:max_len], req.cache_namespace)
        return kv, node

    def prefix_scores(self, req: CachedReq, max_len: int) -> TokenScores:
        return self.tree.prefix_scores(req.fill_ids[:max_len], req.cache_namespace)

    def prefix_len(self, req: CachedReq) -> int:
        return int(self.tree.match_prefix(req.fill_ids[:req.seq_len - 1], req.cache_namespace).kv_indices.numel())

    def should_defer(self, req: CachedReq, batch: Sequence[CachedReq], min_gain: int = 32) -> bool:
        """True when a request already in this prefill batch will cache a longer prefix of req: wait a step."""
        have = self.prefix_len(req)
        ids = req.fill_ids
        for other in batch:
            if other.cache_namespace != req.cache_namespace:
                continue
            o = other.fill_ids
            n = min(len(ids), len(o)) - 1
            i = have
            while i < n and ids[i] == o[i]:
                i += 1
            if i >= have + min_gain:
                return True
        return False

    def dfs_weight_order(self, waiting: list[CachedReq]) -> list[CachedReq]:
        """SGLang's dfs-weight: walk the tree, heaviest subtree (most waiting requests) first."""
        at: dict[int, list[CachedReq]] = {}
        nodes: dict[int, TreeNode] = {}
        for req in waiting:
            node = self.tree.match_prefix(req.fill_ids[:req.seq_len - 1], req.cache_namespace).last_node
            at.setdefault(id(node), []).append(req)
            nodes[id(node)] = node
        weight: dict[int, int] = {}
        for key, reqs in at.items():
            up: TreeNode | None = nodes[key]
            while up is not None:
                weight[id(up)] = weight.get(id(up), 0) + len(reqs)
                up = up.parent
        order: list[CachedReq] = []
        stack = [*self.tree.namespaces.values(), self.tree.root]  # the shared tree first, then each namespace
        while stack:
            node = stack.pop()
            order.extend(at.get(id(node), []))
            kids = [c for c in node.children.values() if id(c) in weight]
            stack.extend(sorted(kids, key=lambda c: weight[id(c)]))  # heaviest popped first
        return order

    def lock(self, node: TreeNode | None) -> None:
        if node is not None:
            self.tree.inc_lock_ref(node)

    def unlock(self, req: CachedReq) -> None:
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)

    def cache_unfinished(self, req: CachedReq) -> None:
        """Insert the request's computed tokens; it keeps running on the tree's copy."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        kv_len = req.kv_len
        tokens = req.fill_ids[:kv_len]
        kv = row[:kv_len].to(torch.int64)
        own_start = int(req.prefix_indices.numel())
        matched = self._insert(req, tokens, kv)
        scores = req.prompt_scores(kv_len)
        if scores is not None:  # a scoring request's prompt logprobs, for the next one that shares its prefix
            self.tree.store_scores(tokens, scores, req.cache_namespace)
        if matched > own_start:  # someone else cached these positions meanwhile: ours are duplicates
            self.kv_pool.free(kv[own_start:matched])
        new_kv, new_node = self._match_inserted(req, tokens)
        n = int(new_kv.numel())
        row[own_start:n] = new_kv[own_start:].to(torch.int32)
        self.tree.inc_lock_ref(new_node)
        self.unlock(req)
        req.prefix_indices, req.last_node = new_kv, new_node

    def _insert(self, req: CachedReq, tokens: list[int], kv: torch.Tensor) -> int:
        """Insert the request's computed tokens; return how many were cached already."""
        return self.tree.insert(tokens, kv, req.cache_namespace)

    def _match_inserted(self, req: CachedReq, tokens: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """The cached copy of tokens just inserted: what the request runs on from now."""
        return self.tree.match_prefix(tokens, req.cache_namespace)

    def release(self, req: CachedReq) -> None:
        """Free the slots the request owns beyond its tree prefix, and its request slot (lock already dropped)."""
        if req.req_pool_idx is None:
            raise RuntimeError("release of a request that holds no request slot")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        own_start = int(req.prefix_indices.numel())
        self.kv_pool.free(row[own_start:req.kv_len].to(torch.int64))
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = 0
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node = None

    def evict(self, num_tokens: int) -> int:
        return self.tree.evict(num_tokens, self.kv_pool.free)

    def room(self) -> int:
        return self.kv_pool.available_size() + self.tree.evictable_size()

    def make_room(self, num_tokens: int) -> None:
        if self.kv_pool.available_size() < num_tokens:
            self.evict(num_tokens - self.kv_pool.available_size())

    def trim_window(self, req: CachedReq) -> None:
        pass  # one slot space: every layer keeps every token

    def swa_cached_size(self) -> int:
        return 0

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        return self.tree.protected_size()

    def cached_size(self) -> int:
        return self.tree.evictable_size() + self.tree.protected_size()

    def reset(self) -> None:
        if self.tree.protected_size() != 0:
            raise RuntimeError(f"reset while requests hold {self.tree.protected_size()} tokens of the tree")
        self.tree.evict(self.tree.evictable_size(), self.kv_pool.free)
        self.tree.reset()
