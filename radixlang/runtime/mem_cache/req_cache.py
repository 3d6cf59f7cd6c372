"""How the scheduler shares KV between requests: through the radix tree, or not at all.

``ReqCache`` is the one protocol; ``TreeReqCache`` (tree_req_cache.py) and ``NoReqCache``
implement it, so the scheduler has no ``if radix_disabled`` branches. They own the frees of
slots a request no longer needs; the tree itself never sees requests or pools. A request is
seen only through ``CachedReq``, the few fields this bookkeeping reads and writes.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch

from radixlang.radix_cache.scores import TokenScores, unknown_scores
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool


class CachedReq(Protocol):
    """What KV bookkeeping needs of a request (the scheduler's ``Req`` has these)."""
    req_pool_idx: int | None
    kv_len: int  # tokens of fill_ids whose KV is in the pool
    prefix_indices: torch.Tensor  # [n] int64 KV slots of the matched prefix
    last_node: Any  # the node locked for this request (None without a tree)
    # the tree namespace its KV is shared in (None: the shared tree); requests whose KV differs for the
    # same tokens live apart (a prompt rotated by its length: models/layers/rotary.py rope_length_key)
    cache_namespace: Hashable | None
    swa_freed_len: int  # its own tokens before this lost their window KV (swa pools: swa_req_cache.py)
    swa_window_released: bool  # its lock no longer holds the window KV of last_node's path (swa pools)

    @property
    def fill_ids(self) -> list[int]: ...

    @property
    def seq_len(self) -> int: ...

    def prompt_scores(self, end: int) -> TokenScores | None:
        """The prompt logprobs it computed for fill_ids[:end] (NaN elsewhere), for the cache to keep."""


class ReqCache(Protocol):
    """KV bookkeeping between the scheduler and the prefix cache (if any).

    ``match`` returns the cached prefix's KV slots and the node to ``lock`` (``unlock(req)`` drops the lock on
    ``req.last_node``); ``cache_unfinished``
    hands a request's computed tokens to the cache (re-pointing its row at shared slots);
    ``prefix_scores`` are the stored prompt logprobs of the longest cached prefix of fill_ids[:max_len]
    (radix_cache/scores.py; NaN where unknown); ``release`` frees what the request still owns and its pool
    slot; ``evict`` frees up to
    ``num_tokens`` unlocked cached slots and returns how many it freed. ``room`` is how many tokens could
    get KV slots now (after evicting), ``make_room(n)`` evicts until n can; ``trim_window`` frees the window
    KV a running request's next queries cannot see (a no-op but for pools with an swa slot space).
    """

    def match(self, req: CachedReq, max_len: int) -> tuple[torch.Tensor, Any]: ...
    def prefix_scores(self, req: CachedReq, max_len: int) -> TokenScores: ...
    def prefix_len(self, req: CachedReq) -> int: ...
    def should_defer(self, req: CachedReq, batch: Sequence[CachedReq]) -> bool: ...
    def dfs_weight_order(self, waiting: list) -> list: ...
    def lock(self, node: Any) -> None: ...
    def unlock(self, req: CachedReq) -> None: ...
    def cache_unfinished(self, req: CachedReq) -> None: ...
    def release(self, req: CachedReq) -> None: ...
    def evict(self, num_tokens: int) -> int: ...
    def room(self) -> int: ...
    def make_room(self, num_tokens: int) -> None: ...
    def trim_window(self, req: CachedReq) -> None: ...
    def swa_cached_size(self) -> int: ...
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def cached_size(self) -> int: ...
    def reset(self) -> None: ...


class NoReqCache:
    """--disable-radix-cache: every request computes its whole prompt; KV is freed at finish."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool

    def match(self, req: CachedReq, max_len: int) -> tuple[torch.Tensor, object]:
        return torch.empty(0, dtype=torch.int64), None

    def prefix_scores(self, req: CachedReq, max_len: int) -> TokenScores:
        return unknown_scores(0)

    def prefix_len(self, req: CachedReq) -> int:
        return 0

    def should_defer(self, req: CachedReq, batch: Sequence[CachedReq]) -> bool:
        return False

    def dfs_weight_order(self, waiting: list) -> list:
        return list(waiting)

    def lock(self, node: object) -> None:
        pass

    def unlock(self, req: CachedReq) -> None:
        pass

    def cache_unfinished(self, req: CachedReq) -> None:
        pass

    def release(self, req: CachedReq) -> None:
        """Free everything the request holds (finish, abort or retraction)."""
        if req.req_pool_idx is None:
            raise RuntimeError("release of a request that holds no request slot")
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, :req.kv_len].to(torch.int64)
        self.kv_pool.free(kv)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = 0
        req.prefix_indices = torch.empty(0, dtype=torch.int64)

    def evict(self, num_tokens: int) -> int:
        return 0

    def room(self) -> int:
        return self.kv_pool.available_size()

    def make_room(self, num_tokens: int) -> None:
        pass  # nothing cached to evict

    def trim_window(self, req: CachedReq) -> None:
        pass  # one slot space: every layer keeps every token

    def swa_cached_size(self) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def cached_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass
