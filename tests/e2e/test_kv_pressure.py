"""A burst larger than the KV pool through a live server: every request finishes with the tokens it
gets alone, the server reports retractions, and no KV slot is held once it is idle.

Talks to the server only over HTTP (through ``live_server``/``Runtime``), so it holds for any
process layout behind the HTTP front.
"""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.live_server import live_server
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

POOL = 400  # KV slots; the burst below needs ~3x that at its peak
NUM_REQUESTS = 16
PARAMS = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def _prompts(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 49000) for _ in range(rng.randrange(16, 48))] for _ in range(NUM_REQUESTS)]


def _generate(client: httpx.Client, ids: list[int], *, stream: bool) -> list[int]:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": PARAMS, "stream": stream}
    if not stream:
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text[:300]
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
        return out["output_ids"]
    frames = []
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        frames = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames and frames[-1] == "[DONE]", frames[-2:]
    last = json.loads(frames[-2])
    assert last["meta_info"]["finish_reason"]["type"] == "length", last["meta_info"]
    return last["output_ids"]


def _idle_info(client: httpx.Client) -> dict[str, Any]:
    def idle() -> dict[str, Any] | None:
        info = client.get("/get_server_info").json()
        return None if info["num_running_reqs"] or info["num_waiting_reqs"] else info
    return wait_until(idle, what="no running or waiting request")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with live_server(tiny_model_dir, max_total_tokens=POOL) as url:
        yield url


def test_burst_larger_than_kv_pool(server):
    prompts = _prompts()
    assert sum(len(p) + PARAMS["max_new_tokens"] for p in prompts) > 2 * POOL
    with httpx.Client(base_url=server, timeout=120) as c:
        before = c.get("/get_server_info").json()["num_retractions"]
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:  # every request in flight at once; half of them streamed
            burst = list(pool.map(lambda i: _generate(c, prompts[i], stream=i % 2 == 1), range(NUM_REQUESTS)))
        info = _idle_info(c)
        assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        assert info["num_retractions"] > before, "the pool was too small for the burst, yet nothing was retracted"
        mem = info["memory"]
        assert mem["kv_total_tokens"] == POOL
        assert mem["kv_free_tokens"] + mem["kv_cached_tokens"] == mem["kv_total_tokens"], mem  # no leaked slot
        alone = []
        for ids in prompts:  # the reference: each request alone on an empty cache
            assert c.post("/flush_cache").status_code == 200
            alone.append(_generate(c, ids, stream=False))
        assert c.post("/flush_cache").status_code == 200
        mem = _idle_info(c)["memory"]
        assert mem["kv_free_tokens"] == mem["kv_total_tokens"], mem  # flushed and idle: every slot is free
    assert all(len(out) == PARAMS["max_new_tokens"] for out in burst)
    for i, (got, ref) in enumerate(zip(burst, alone)):
        assert got == ref, f"request {i} in the burst diverged from itself alone"


def test_request_longer_than_the_pool_is_capped_not_fatal(server):
    # prompt + max_new_tokens > the whole pool: no retraction can make room for a lone request, so the
    # server caps its budget (as it does at the context length) instead of failing every request
    prompt = list(range(1000, 1000 + POOL // 2))
    with httpx.Client(base_url=server, timeout=120) as c:
        r = c.post("/generate", json={"input_ids": prompt, "sampling_params": {**PARAMS, "max_new_tokens": POOL}})
        assert r.status_code == 200, r.text[:300]
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert 0 < meta["completion_tokens"] <= POOL - len(prompt)
        after = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}})
        assert after.status_code == 200 and after.json()["meta_info"]["completion_tokens"] == 3
        mem = _idle_info(c)["memory"]
        assert mem["kv_free_tokens"] + mem["kv_cached_tokens"] == mem["kv_total_tokens"], mem
