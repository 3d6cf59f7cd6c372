"""The routing simulator (bench/routing_sim.py, routing_trace.py, routing_smg.py) on small traces."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import asdict

import pytest

from bench.routing_sim import POLICY_NAMES, WorkerConfig, run, scaled_trace_config, simulate
from bench.routing_smg import MultiTenantTree, SmgCacheAware, SmgConfig
from bench.routing_trace import TraceConfig, make_trace

# 4 workers whose KV holds about two tenants' prefixes: round robin, which sends every tenant everywhere,
# has to evict; a cache-aware router that keeps each tenant on one worker does not
SMALL = WorkerConfig(kv_tokens=8192)


@pytest.fixture(scope="module")
def small_results():
    return run([4], requests_per_worker=30, seed=1, wcfg=SMALL)


def _by_policy(results):
    return {r.policy: r for r in results}


def test_every_request_is_routed_and_admitted_exactly_once(small_results):
    trace = make_trace(scaled_trace_config(4, requests_per_worker=30, wcfg=SMALL, seed=1))
    prompt_tokens = sum(len(r.prompt_ids) for r in trace)
    for r in small_results:
        assert r.num_requests == len(trace) == len(r.routed)
        assert all(0 <= w < 4 for w in r.routed)  # -1 would mean never routed
        assert r.prompt_tokens == prompt_tokens  # each request admitted once, none left queued


def test_round_robin_takes_workers_in_turn(small_results):
    counts = Counter(_by_policy(small_results)["round_robin"].routed)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_cache_aware_policies_beat_round_robin_on_hit_rate(small_results):
    res = _by_policy(small_results)
    assert res["radixlang"].hit_rate > res["round_robin"].hit_rate + 0.2
    assert res["smg"].hit_rate > res["round_robin"].hit_rate + 0.2
    assert all(0.0 <= r.hit_rate <= 1.0 for r in small_results)


def test_imbalance_is_at_least_one(small_results):
    assert {r.policy for r in small_results} == set(POLICY_NAMES)
    assert all(r.imbalance >= 1.0 for r in small_results)


def _without_timing(results):
    return [{k: v for k, v in asdict(r).items() if k != "route_us"} for r in results]


def test_same_seed_gives_the_same_table_and_another_seed_does_not(small_results):
    assert _without_timing(run([4], requests_per_worker=30, seed=1, wcfg=SMALL)) == _without_timing(small_results)
    assert _without_timing(run([4], requests_per_worker=30, seed=2, wcfg=SMALL)) != _without_timing(small_results)


def test_trace_turns_extend_the_previous_turn():
    trace = make_trace(TraceConfig(num_tenants=3, num_conversations=20, conversations_per_s=1.0, seed=3))
    followed = [r for r in trace if r.next_turn is not None]
    assert followed  # multi-turn chats exist
    for r in followed:
        nxt = r.next_turn
        assert nxt is not None and nxt.arrival_s is None
        assert nxt.prompt_ids[:len(r.prompt_ids) + len(r.output_ids)] == r.prompt_ids + r.output_ids


def test_kv_too_small_for_the_longest_request_is_refused():
    with pytest.raises(ValueError, match="kv_tokens"):
        run([2], requests_per_worker=2, seed=0, wcfg=WorkerConfig(kv_tokens=1000))


def test_simulate_refuses_an_unknown_policy():
    trace = make_trace(TraceConfig(num_tenants=1, num_conversations=2, conversations_per_s=1.0))
    with pytest.raises(ValueError, match="policy"):
        simulate("random", trace, 2, SMALL)


# ---- the SMG tree and policy ---------------------------------------------------------------------------
def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_multi_tenant_tree_matches_brute_force():
    rng = random.Random(0)
    tree = MultiTenantTree(3)
    inserted: list[tuple[str, int]] = []  # (text, worker)
    bases = ["".join(rng.choice("0123 ") for _ in range(12)) for _ in range(4)]
    for _ in range(300):
        text = rng.choice(bases)[:rng.randrange(13)] + "".join(rng.choice("0123 ") for _ in range(rng.randrange(5)))
        probe = rng.choice(bases) + "9"
        matched, tenant = tree.match(probe)
        assert matched == max((_common(probe, t) for t, _ in inserted), default=0)
        if matched:  # the tenant named was really sent a text sharing that prefix
            assert any(w == tenant and _common(probe, t) >= matched for t, w in inserted)
        if text:
            worker = rng.randrange(3)
            tree.insert(text, worker)
            inserted.append((text, worker))
    for worker in range(3):  # each tenant counts the distinct prefixes it holds
        held = {t[:k] for t, w in inserted if w == worker for k in range(1, len(t) + 1)}
        assert tree.tenant_chars[worker] == len(held)


def test_multi_tenant_tree_evicts_each_tenant_to_its_bound_oldest_first():
    tree = MultiTenantTree(2)
    tree.insert("aaaa", 0)
    tree.insert("bbbb", 0)
    tree.insert("cccc", 1)
    tree.insert("aaaa", 0)  # now b is worker 0's oldest
    tree.evict_tenant_by_size(4)
    assert tree.tenant_chars == [4, 4]
    assert tree.match("bbbb") == (0, None)
    assert tree.match("aaaa") == (4, 0) and tree.match("cccc") == (4, 1)


def test_smg_follows_the_prefix_when_balanced_and_the_least_loaded_when_not():
    smg = SmgCacheAware(2, SmgConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    text = "1 2 3 4 5 6 7 8"
    first = smg.select(text)
    assert [smg.select(text + " 9") for _ in range(2)] == [first] * 2  # match rate > 0.3; 1, 2 vs 0 in flight
    assert smg.select(text) == 1 - first  # 3 vs 0: imbalanced, the least-loaded worker takes it
    for _ in range(3):
        smg.finished(first)
    with pytest.raises(ValueError, match="no request in flight"):
        smg.finished(first)
