"""A forced tool_choice (named or required) answers with one call unless parallel_tool_calls asks for
more (issue #42 item 4): a model left free to go on repeats the same call, and an agent runs it twice."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from radixlang.runtime.entrypoints.engine_front import EngineFront
from radixlang.runtime.entrypoints.http_server import create_app
from radixlang.runtime.entrypoints.openai.protocol import ChatRequest
from radixlang.runtime.entrypoints.openai.serving import _parallel

pytestmark = pytest.mark.e2e

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(tiny_engine):
    with TestClient(create_app(EngineFront(tiny_engine))) as c:
        yield c


def _choice(c, **body) -> dict:
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                             "tools": TOOLS, "max_tokens": 160, "logprobs": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1, "seed": 1},
                                      {"temperature": 1, "seed": 2}], ids=["greedy", "seed1", "seed2"])
def test_a_forced_tool_choice_makes_one_call(client, tool_choice, sampling):
    choice = _choice(client, tool_choice=tool_choice, **sampling)
    raw = "".join(e["token"] for e in choice["logprobs"]["content"])
    assert raw.count("<tool_call>") == 1, raw  # the grammar ended after the call: no second one written
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])


def test_parallel_tool_calls_decides_how_many_calls():
    def parallel(**body) -> bool:
        req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, **body)
        return _parallel(req, [t for t in req.tools or []])
    assert not parallel(tool_choice=NAMED) and not parallel(tool_choice="required")
    assert parallel(tool_choice=NAMED, parallel_tool_calls=True) and parallel(tool_choice="required",
                                                                             parallel_tool_calls=True)
    assert parallel(tool_choice="auto") and parallel() and not parallel(tool_choice="auto", parallel_tool_calls=False)
