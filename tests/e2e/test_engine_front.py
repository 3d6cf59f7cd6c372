"""The HTTP app served in-process over an Engine (EngineFront), no subprocess."""
from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from radixlang.runtime.entrypoints.engine_front import EngineFront
from radixlang.runtime.entrypoints.http_server import create_app

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(tiny_engine):
    with TestClient(create_app(EngineFront(tiny_engine))) as c:
        yield c


def test_routes_over_an_in_process_engine(client):
    assert client.get("/health").status_code == 200
    out = client.post("/generate", json={"text": "a b c", "sampling_params": {"max_new_tokens": 3,
                                                                           "ignore_eos": True}}).json()
    assert out["meta_info"]["completion_tokens"] == 3
    r = client.post("/generate", json={"text": "x", "sampling_params": {"top_p": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    frames = [line[6:] for line in client.post("/generate", json={
        "text": "s", "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}).iter_lines()
        if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["meta_info"]["completion_tokens"] == 4
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2}).json()
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert client.get("/get_server_info").json()["memory"]["kv_total_tokens"] == 8192
    assert "radixlang_num_requests_total" in client.get("/metrics").text


def test_streamed_stop_regex_adds_up_to_the_whole_reply(client):
    params = {"max_new_tokens": 24, "temperature": 0}
    free = client.post("/generate", json={"text": "Count:", "sampling_params": params}).json()["text"]
    mid = len(free) // 2
    pattern = "(?:" + re.escape(free[mid:mid + 3]) + ")"  # a regex the greedy reply is known to match
    body = {"text": "Count:", "sampling_params": {**params, "stop_regex": [pattern]}}
    whole = client.post("/generate", json=body).json()
    assert whole["meta_info"]["finish_reason"]["matched"] == pattern
    frames = [json.loads(line[6:]) for line in client.post("/generate", json={**body, "stream": True}).iter_lines()
              if line.startswith("data: {")]
    texts = [f["text"] for f in frames]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # a stream never takes text back
    assert texts[-1] == whole["text"] == free[:re.search(pattern, free).start()]
