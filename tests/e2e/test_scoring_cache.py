"""Prompt logprobs from the radix cache: a scoring request that shares a prefix with an earlier one
computes only its uncached suffix and reports what a cold run reports.

Cold runs are the same request after ``flush_cache`` on the same engine or server. The values are
compared exactly: a stored score is the very float32 a forward computed for that token after the
same prefix, and on the CPU torch path a row's logits do not depend on the other rows of its step.
"""
from __future__ import annotations

import random

import httpx
import pytest

from radixlang import Engine
from tests.live_server import live_server

pytestmark = pytest.mark.e2e


def _items(n: int, seed: int = 3) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49000) for _ in range(120)]
    return prefix, [prefix + [rng.randrange(3, 49000) for _ in range(rng.randrange(2, 9))] for _ in range(n)]


def _score(engine: Engine, ids: list[int], start: int, top: int, max_new: int = 0) -> dict:
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new, "temperature": 0},
                          return_logprob=True, logprob_start_len=start, top_logprobs_num=top)
    return out["meta_info"]


def _report(meta: dict) -> tuple:
    return meta["input_token_logprobs"], meta.get("input_top_logprobs")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=8192) as e:
        yield e


@pytest.mark.parametrize("start,top", [(0, 0), (0, 2), (1, 0), (40, 3), (115, 1)])
def test_cached_scores_equal_a_cold_run(engine, start, top):
    _, prompts = _items(3)
    assert engine.flush_cache()
    _score(engine, prompts[0], start, top)
    warm = [_score(engine, p, start, top) for p in prompts[1:]]
    # the 120-token shared prefix is scored from the tree, not recomputed (before, a request scored from
    # position k matched at most k - 1 tokens)
    assert all(m["cached_tokens"] >= 119 for m in warm)
    cold = []
    for p in prompts[1:]:
        assert engine.flush_cache()
        cold.append(_score(engine, p, start, top))
    assert all(m["cached_tokens"] == 0 for m in cold)
    assert [_report(m) for m in warm] == [_report(m) for m in cold]
    assert all(len(m["input_token_logprobs"]) == len(p) - min(start, len(p) - 1) for m, p in zip(warm, prompts[1:]))
    engine.check_memory_leak()


def test_unscored_or_narrower_prefixes_are_recomputed(engine):
    """A prefix cached without scores, or with a top-k narrower than asked, is not reported from the tree
    where it lacks what the request needs; once scored wide enough it is."""
    _, prompts = _items(4, seed=5)
    assert engine.flush_cache()
    engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    plain = _score(engine, prompts[1], 0, 0)
    assert plain["cached_tokens"] == 0  # the cached prefix has no scores: everything is recomputed
    narrow = _score(engine, prompts[2], 0, 3)  # the tree holds no top-k yet
    wide = _score(engine, prompts[3], 0, 2)  # top-3 rows serve a top-2 request
    assert narrow["cached_tokens"] == 0 and wide["cached_tokens"] >= 115
    cold = []
    for p, top in ((prompts[1], 0), (prompts[2], 3), (prompts[3], 2)):
        assert engine.flush_cache()
        cold.append(_score(engine, p, 0, top))
    assert [_report(m) for m in (plain, narrow, wide)] == [_report(m) for m in cold]
    engine.check_memory_leak()


def test_generation_after_cached_scores_is_unchanged(engine):
    _, prompts = _items(2, seed=7)
    assert engine.flush_cache()
    _score(engine, prompts[0], 0, 1)
    warm = _score(engine, prompts[1], 0, 1, max_new=4)
    warm_out = warm["output_token_logprobs"]
    assert engine.flush_cache()
    cold = _score(engine, prompts[1], 0, 1, max_new=4)
    assert warm["cached_tokens"] > 0 and cold["cached_tokens"] == 0
    assert _report(warm) == _report(cold) and warm_out == cold["output_token_logprobs"]


def test_http_generate_and_completions_echo(tiny_model_dir):
    """/generate with logprob_start_len 0 and /v1/completions echo + logprobs (what lm-eval's
    local-completions sends): the second item is served from the cache and scores as a cold run."""
    _, prompts = _items(2, seed=11)
    with live_server(tiny_model_dir, max_total_tokens=8192) as url, httpx.Client(base_url=url, timeout=120) as http:
        def generate(ids: list[int]) -> dict:
            r = http.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                             "top_logprobs_num": 2,
                                             "sampling_params": {"max_new_tokens": 0, "temperature": 0}})
            assert r.status_code == 200, r.text
            return r.json()["meta_info"]

        def complete(ids: list[int]) -> dict:
            r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0,
                                                   "echo": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            return r.json()

        def flush() -> None:
            assert http.post("/flush_cache").status_code == 200

        for send, cached in ((generate, lambda m: m["cached_tokens"]),
                             (complete, lambda c: c["usage"]["prompt_tokens_details"]["cached_tokens"])):
            flush()
            send(prompts[0])
            warm = send(prompts[1])
            flush()
            cold = send(prompts[1])
            assert cached(warm) >= 115 and cached(cold) == 0
            if send is complete:
                warm, cold = warm["choices"][0]["logprobs"], cold["choices"][0]["logprobs"]
                assert warm["token_logprobs"][0] is None and len(warm["token_logprobs"]) == len(prompts[1]) + 1
            else:
                warm = {k: warm[k] for k in ("input_token_logprobs", "input_top_logprobs")}
                cold = {k: cold[k] for k in ("input_token_logprobs", "input_top_logprobs")}
            assert _close(warm, cold)


def _close(a: object, b: object) -> bool:
    """Equal structure and ids; floats within float32 rounding (1e-6 relative). The server's CPU kernels
    block a matmul by its row count, so the first row computed after the cached prefix (a 7-row extend
    warm, a 127-row one cold) may round its last bit differently; the stored rows are exact copies."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-6, abs=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b
