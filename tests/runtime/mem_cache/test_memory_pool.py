"""The KV pools refuse bookkeeping errors with RuntimeError (kept under python -O, unlike assert)."""
from __future__ import annotations

import pytest
import torch

from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.mem_cache.req_cache import NoReqCache


def _kv(size: int = 8) -> TokenToKVPool:
    return TokenToKVPool(size, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu")


def test_kv_pool_hands_out_every_slot_but_the_dummy_and_refuses_double_frees():
    pool = _kv(8)
    slots = pool.alloc(8)
    assert sorted(slots.tolist()) == list(range(1, 9)) and pool.alloc(1) is None
    pool.free(slots[:3])
    with pytest.raises(RuntimeError, match="double free of KV slots"):
        pool.free(slots[2:4])
    with pytest.raises(RuntimeError, match="dummy KV slot 0"):
        pool.free(torch.tensor([0]))
    assert pool.available_size() == 3


def test_req_pool_refuses_double_and_out_of_range_frees():
    pool = ReqToTokenPool(2, 4, "cpu")
    (a,) = pool.alloc(1)
    pool.free(a)
    with pytest.raises(RuntimeError, match=f"double free of req slot {a}"):
        pool.free(a)
    with pytest.raises(RuntimeError, match="outside the pool"):
        pool.free(5)


def test_no_req_cache_refuses_to_release_a_request_without_a_slot():
    class _Req:
        req_pool_idx = None
        kv_len = 0
    cache = NoReqCache(ReqToTokenPool(2, 4, "cpu"), _kv())
    with pytest.raises(RuntimeError, match="holds no request slot"):
        cache.release(_Req())
