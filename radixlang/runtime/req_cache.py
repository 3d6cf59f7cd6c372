"""How the scheduler shares KV between requests: through the radix tree, or not at all.

Both classes do the same bookkeeping calls so the scheduler has no
``if radix_disabled`` branches. They own the frees of slots a request no
longer needs; the tree itself never sees requests or pools.
"""
from __future__ import annotations

import torch

from radixlang.runtime.batch import Req
from radixlang.runtime.memory_pool import ReqToTokenPool, TokenToKVPool


class NoReqCache:
    """--disable-radix-cache: every request computes its whole prompt; KV is freed at finish."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool

    def match(self, req: Req, max_len: int) -> tuple[torch.Tensor, object]:
        return torch.empty(0, dtype=torch.int64), None

    def prefix_len(self, req: Req) -> int:
        return 0

    def should_defer(self, req: Req, batch: list[Req]) -> bool:
        return False

    def dfs_weight_order(self, waiting: list[Req]) -> list[Req]:
        return list(waiting)

    def lock(self, node: object) -> None:
        pass

    def unlock(self, node: object) -> None:
        pass

    def cache_unfinished(self, req: Req) -> None:
        pass

    def release(self, req: Req) -> None:
        """Free everything the request holds (finish, abort or retraction)."""
        assert req.req_pool_idx is not None
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, :req.kv_len].to(torch.int64)
        self.kv_pool.free(kv)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = 0
        req.prefix_indices = torch.empty(0, dtype=torch.int64)

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def cached_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass
