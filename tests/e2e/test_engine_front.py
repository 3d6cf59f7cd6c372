"""The HTTP app served in-process over an Engine (EngineFront), no subprocess."""
from __future__ import annotations

import json

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
