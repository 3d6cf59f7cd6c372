"""On the OpenAI chat route, logprobs never change a constrained reply (issue #42 item 1): the same
tokens with and without logprobs / top_logprobs for response_format json_schema, SGLang's regex and
ebnf extensions and forced tool calls, greedy and seeded, whole and streamed."""
from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from radixlang.runtime.entrypoints.engine_front import EngineFront
from radixlang.runtime.entrypoints.http_server import create_app

pytestmark = pytest.mark.e2e

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CONSTRAINTS = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
    "regex": {"regex": r"(yes|no), the answer is [0-9]{2} exactly\."},
    "ebnf": {"ebnf": 'root ::= "greeting: hello " name " and goodbye"\nname ::= [a-z]{1,6}'},
    "tool_named": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "tool_required": {"tools": TOOLS, "tool_choice": "required"},
}
LOGPROBS = ({}, {"logprobs": True}, {"logprobs": True, "top_logprobs": 2})


@pytest.fixture(scope="module")
def client(tiny_engine):
    with TestClient(create_app(EngineFront(tiny_engine))) as c:
        yield c


def _chat(c, **body) -> dict:
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Bob is 42."}],
                                             "max_tokens": 120, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _reply(choice: dict) -> tuple:
    msg = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    return msg["content"], calls, choice["finish_reason"]


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1, "seed": 4}], ids=["greedy", "seeded"])
def test_logprobs_do_not_change_the_reply(client, kind, sampling):
    replies = []
    for lp in LOGPROBS:
        body = _chat(client, **CONSTRAINTS[kind], **sampling, **lp)
        choice = body["choices"][0]
        replies.append((_reply(choice), body["usage"]["completion_tokens"]))
        if lp:
            entries = choice["logprobs"]["content"]
            assert len(entries) == body["usage"]["completion_tokens"]
            assert all(len(e["top_logprobs"]) == lp.get("top_logprobs", 0) for e in entries)
    assert replies[1] == replies[0] and replies[2] == replies[0], replies
    (content, calls, finish), _ = replies[0]
    if kind.startswith("tool"):
        assert finish == "tool_calls" and len(calls) == 1
        jsonschema.validate(json.loads(calls[0][1]), WEATHER)
    else:
        assert finish == "stop", replies[0]
    if kind == "json_schema":
        jsonschema.validate(json.loads(content), PERSON)


@pytest.mark.parametrize("kind", ["json_schema", "tool_named"])
def test_streamed_logprobs_match_the_whole_reply(client, kind):
    body = {**CONSTRAINTS[kind], "temperature": 0, "logprobs": True}
    whole = _chat(client, **body)["choices"][0]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Bob is 42."}],
                                                  "max_tokens": 120, "stream": True, **body})
    chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    entries = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in entries] == [e["token"] for e in whole["logprobs"]["content"]]
    assert [e["logprob"] for e in entries] == pytest.approx([e["logprob"] for e in whole["logprobs"]["content"]],
                                                            abs=1e-4)
