"""The Engine and the server route alike under KV pressure: both run the one request front, whose
router trees are sized from the KV pool each replica reports, so the same dp=2 workload goes to
the same replicas in both, even when the pools (and so the router's trees) are too small to hold it."""
from __future__ import annotations

import random

import httpx
import pytest

from radixlang import Engine
from radixlang.runtime.dp.router import Router
from tests.live_server import live_server

pytestmark = pytest.mark.e2e

POOL = 256  # KV slots per replica: holds two of the six prefixes, so trees evict
GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


def _workload(seed: int = 0) -> list[list[int]]:
    """6 prefixes of 100 ids, each asked 3 times (rounds shuffled), with a short distinct suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(100)] for _ in range(6)]
    out = []
    for _ in range(3):
        order = list(range(len(prefixes)))
        rng.shuffle(order)
        out.extend(prefixes[p] + [rng.randrange(3, 1000) for _ in range(rng.randrange(2, 10))] for p in order)
    return out


def _replica(before: list[int], after: list[int]) -> int:
    diff = [a - b for a, b in zip(after, before)]
    assert sorted(diff) == [0, 1], diff  # exactly one request was routed, to one replica
    return diff.index(1)


def _engine_decisions(model_dir: str, workload: list[list[int]]) -> tuple[list[int], dict]:
    with Engine(model_path=model_dir, load_format="dummy", max_total_tokens=POOL, dp_size=2,
                load_balance_method="cache_aware") as engine:
        decisions = []
        for ids in workload:  # one at a time: nothing in flight when the next is routed
            before = engine.get_server_info()["router"]["routed"]
            out = engine.generate(input_ids=ids, sampling_params=GREEDY)
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            decisions.append(_replica(before, engine.get_server_info()["router"]["routed"]))
        info = engine.get_server_info()
        engine.check_memory_leak()
    return decisions, info


def _server_decisions(model_dir: str, workload: list[list[int]]) -> tuple[list[int], dict]:
    with live_server(model_dir, max_total_tokens=POOL, dp_size=2, load_balance_method="cache_aware") as url, \
            httpx.Client(base_url=url, timeout=120) as c:
        decisions = []
        for ids in workload:
            before = c.get("/get_server_info").json()["router"]["routed"]
            out = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
            assert out.status_code == 200 and out.json()["meta_info"]["finish_reason"]["type"] == "length"
            decisions.append(_replica(before, c.get("/get_server_info").json()["router"]["routed"]))
        info = c.get("/get_server_info").json()
    return decisions, info


def _simulate(workload: list[list[int]], max_tree_tokens: int) -> list[int]:
    router = Router(2, policy="cache_aware", max_tree_tokens=max_tree_tokens)
    decisions = []
    for ids in workload:
        decisions.append(router.select(ids))
        router.finished(decisions[-1])
    return decisions


def test_engine_and_server_route_identically_under_kv_pressure(tiny_model_dir):
    workload = _workload()
    # the workload is one where a tree bounded by the pool routes otherwise than an unbounded one
    assert _simulate(workload, POOL) != _simulate(workload, 1 << 30)
    engine, engine_info = _engine_decisions(tiny_model_dir, workload)
    server, server_info = _server_decisions(tiny_model_dir, workload)
    assert engine == server
    for info in (engine_info, server_info):
        assert info["memory"]["kv_total_tokens"] == 2 * POOL
        assert max(info["router"]["tree_tokens"]) <= POOL  # the router's trees evicted with the pools
        assert info["router"]["in_flight"] == [0, 0]
    assert engine == _simulate(workload, POOL)  # each tree is bounded by its replica's reported pool
    assert min(engine.count(0), engine.count(1)) > 0
