"""Data-parallel Engine (dp_size=2) on the tiny model: same greedy outputs as dp=1, cache-aware routing
beats round robin on a shared-prefix workload, control calls reach every replica, no KV leaks."""
from __future__ import annotations

import random

import pytest

from radixlang import Engine

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
DP_ENGINES = ("dp_cache_aware", "dp_round_robin")


def _make(tiny_model_dir: str, method: str) -> Engine:
    return Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=4096, dp_size=2,
                  load_balance_method=method)


@pytest.fixture(scope="module")
def dp_cache_aware(tiny_model_dir):
    with _make(tiny_model_dir, "cache_aware") as engine:
        yield engine


@pytest.fixture(scope="module")
def dp_round_robin(tiny_model_dir):
    with _make(tiny_model_dir, "round_robin") as engine:
        yield engine


@pytest.fixture(autouse=True)
def _no_leak(request):
    yield
    for name in ("tiny_engine", *DP_ENGINES):
        if name in request.fixturenames:
            request.getfixturevalue(name).check_memory_leak()


def _waves(seed: int = 0) -> list[list[list[int]]]:
    """3 few-shot prefixes (odd, so round robin cannot line up with them), 3 waves of 9 shuffled requests."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 49000) for _ in range(96)] for _ in range(3)]
    waves = []
    for _ in range(3):
        wave = [p + [rng.randrange(3, 49000) for _ in range(rng.randrange(4, 12))] for p in prefixes for _ in range(3)]
        rng.shuffle(wave)
        waves.append(wave)
    return waves


def test_dp_outputs_equal_dp1(tiny_engine, dp_cache_aware, dp_round_robin):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randrange(1, 80))] for _ in range(12)]
    ref = [o["output_ids"] for o in tiny_engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    for engine in (dp_cache_aware, dp_round_robin):
        before = engine.router.stats()["routed"]
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == ref
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        routed = [a - b for a, b in zip(engine.router.stats()["routed"], before)]
        assert sum(routed) == len(prompts) and min(routed) > 0
        assert engine.router.stats()["in_flight"] == [0, 0]


def _hit_rate(engine: Engine) -> tuple[float, list[int]]:
    assert engine.flush_cache() is True
    before = engine.get_server_info()
    for wave in _waves():
        engine.generate(input_ids=wave, sampling_params=GREEDY)
    after = engine.get_server_info()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    per_replica = [a["num_requests"] - b["num_requests"] for a, b in zip(after["replicas"], before["replicas"])]
    return cached / prompt, per_replica


def test_cache_aware_hits_more_than_round_robin(dp_cache_aware, dp_round_robin):
    aware, aware_split = _hit_rate(dp_cache_aware)
    rr, rr_split = _hit_rate(dp_round_robin)
    assert aware > rr, (aware, rr)
    assert sum(aware_split) == sum(rr_split) == 27
    assert min(aware_split) > 0 and min(rr_split) > 0  # both routers used both replicas


def test_server_info_sums_replicas(dp_cache_aware):
    dp_cache_aware.generate(input_ids=[[5, 6, 7], [8, 9, 10, 11]], sampling_params=GREEDY)
    info = dp_cache_aware.get_server_info()
    reps = info["replicas"]
    assert len(reps) == 2 and info["dp_size"] == 2
    for key in ("num_requests", "prompt_tokens", "cached_tokens", "generated_tokens", "forward_steps"):
        assert info[key] == reps[0][key] + reps[1][key]
    assert info["memory"]["kv_total_tokens"] == 2 * reps[0]["memory"]["kv_total_tokens"] == 2 * 4096
    e2e = info["latency"]["e2e_request_latency_seconds"]
    assert e2e["count"] == info["num_requests"] == sum(e2e["counts"])
    assert info["cache_hit_rate"] == pytest.approx(info["cached_tokens"] / info["prompt_tokens"])
    assert dp_cache_aware.flush_cache() is True
    assert dp_cache_aware.get_server_info()["memory"]["kv_cached_tokens"] == 0
    assert dp_cache_aware.router.stats()["tree_tokens"] == [0, 0]  # the router forgets flushed caches too


def test_abort_reaches_the_right_replica(dp_round_robin):
    # round robin: the first stream goes to one replica, the one to abort to the other
    keep = dp_round_robin.generate(input_ids=[5, 6], sampling_params={**GREEDY, "max_new_tokens": 40}, stream=True)
    it = dp_round_robin.generate(input_ids=[7, 8], sampling_params={"max_new_tokens": 400, "ignore_eos": True},
                                 stream=True, rid="dp-abort")
    next(it)
    dp_round_robin.abort_request("dp-abort")
    last = list(it)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and len(last["output_ids"]) < 400
    assert len(list(keep)[-1]["output_ids"]) == 40
    assert dp_round_robin.router.stats()["in_flight"] == [0, 0]


def test_metrics_render_summed_replicas(dp_round_robin):
    from radixlang.runtime.entrypoints.metrics import make_registry, render
    dp_round_robin.generate(input_ids=[[5, 6, 7], [8, 9, 10]], sampling_params=GREEDY)
    info = dp_round_robin.get_server_info()
    text = render(make_registry(dp_round_robin.get_server_info)).decode()
    assert f"radixlang_num_requests_total {float(info['num_requests'])}" in text
    assert f"radixlang_kv_total_tokens {float(2 * 4096)}" in text


def test_a_crashed_replica_fails_its_requests_and_the_engine(tiny_model_dir):
    engine = _make(tiny_model_dir, "round_robin")
    try:
        def boom():
            raise RuntimeError("replica 1 exploded")
        engine.schedulers[1].step = boom
        outs = engine.generate(input_ids=[[5, 6, 7], [8, 9, 10]], sampling_params=GREEDY)
        assert outs[0]["meta_info"]["finish_reason"]["type"] == "length"  # replica 0 still served its request
        assert outs[1]["meta_info"]["finish_reason"] == {"type": "abort",
                                                         "message": "engine error: replica 1 exploded"}
        assert engine.router.stats()["in_flight"] == [0, 0]
        with pytest.raises(RuntimeError, match="the engine has failed: replica 1 exploded"):
            engine.generate(input_ids=[5, 6], sampling_params=GREEDY)
    finally:
        engine.shutdown()
