"""Forced tool calls in the parser's own format, and grammars that start after the reasoning, on
the OpenAI chat route over an in-process Engine (tiny random model)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
from fastapi.testclient import TestClient

from radixlang import Engine
from radixlang.runtime.entrypoints.engine_front import EngineFront
from radixlang.runtime.entrypoints.http_server import create_app
from radixlang.runtime.entrypoints.openai.protocol import ChatRequest
from radixlang.runtime.entrypoints.openai.serving import _constrain_after_reasoning
from radixlang.runtime.errors import RequestError

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["city", "n"]}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]
BY_NAME = {"get_weather": SCHEMA, "get_time": ZONE}
# the tiny model spells "</think>" as these three tokens: biased up, a sampled reply soon closes its reasoning
THINK_END_BIAS = {"9617": 100, "17400": 100, "46": 100}


@pytest.fixture(scope="module")
def client(tiny_engine):
    with TestClient(create_app(EngineFront(tiny_engine))) as c:
        yield c


@pytest.fixture(scope="module")
def thinking(tiny_model_dir):
    engine = Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=4096,
                    reasoning_parser="deepseek-r1")
    with TestClient(create_app(EngineFront(engine))) as c:
        yield c
    engine.shutdown()


def _chat(c, **body) -> dict:
    """One choice; logprobs=True (the default here) shows the raw reply (the tokens are those without it)."""
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "call"}], "max_tokens": 200,
                                             "logprobs": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _raw(choice: dict) -> str:
    return "".join(e["token"] for e in choice["logprobs"]["content"])


def _check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["function"]["name"] in names and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), BY_NAME[call["function"]["name"]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_writes_calls_in_the_models_format(client, seed):
    choice = _chat(client, tools=TOOLS, tool_choice="required", temperature=1, seed=seed)
    assert _raw(choice).startswith('<tool_call>\n{"name": "')  # hermes, the tiny model's (auto) format
    assert choice["finish_reason"] == "tool_calls"
    _check_calls(choice["message"]["tool_calls"], set(BY_NAME))


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_one_call_streamed_or_not(client, stream):
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "parallel_tool_calls": False, "temperature": 0}
    whole = _chat(client, **body)
    raw = _raw(whole)
    assert raw.count("<tool_call>") == 1 and raw.removesuffix("<|im_end|>").endswith("</tool_call>")
    _check_calls(whole["message"]["tool_calls"], {"get_time"})
    if not stream:
        return
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "call"}],
                                                  "max_tokens": 200, "stream": True, **body})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines() if line.startswith("data: {")]
    entries = [e for d in deltas for e in d.get("tool_calls", [])]
    assert entries[0]["function"]["name"] == "get_time"
    assert "".join(e["function"]["arguments"] for e in entries) == whole["message"]["tool_calls"][0]["function"][
        "arguments"]


@pytest.mark.parametrize("seed", [0, 1])
def test_response_format_applies_after_the_reasoning(thinking, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    choice = _chat(thinking, temperature=1, seed=seed, max_tokens=400, logit_bias=THINK_END_BIAS, response_format=fmt)
    assert choice["finish_reason"] == "stop"
    raw = _raw(choice)
    assert "</think>" in raw and not raw.startswith("{")  # free reasoning text first
    assert choice["message"]["reasoning_content"]
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    jumped = _chat(thinking, temperature=1, seed=seed, max_tokens=400, logit_bias=THINK_END_BIAS, response_format=fmt,
                   logprobs=False)  # with jump-forward after the switch
    assert jumped["finish_reason"] == "stop" and jumped["message"]["reasoning_content"]
    jsonschema.validate(json.loads(jumped["message"]["content"]), SCHEMA)


def test_forced_calls_after_the_reasoning_streamed(thinking):
    body = {"tools": TOOLS, "tool_choice": "required", "temperature": 1, "seed": 1, "max_tokens": 400,
            "logit_bias": THINK_END_BIAS, "logprobs": False}
    whole = _chat(thinking, **body)
    assert whole["message"]["reasoning_content"]
    _check_calls(whole["message"]["tool_calls"], set(BY_NAME))
    r = thinking.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "call"}],
                                                    "stream": True, **body})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["message"]["reasoning_content"]
    args: dict[int, str] = {}
    for e in (e for d in deltas for e in d.get("tool_calls", [])):
        args[e["index"]] = args.get(e["index"], "") + e["function"]["arguments"]
    assert list(args.values()) == [c["function"]["arguments"] for c in whole["message"]["tool_calls"]]


def test_which_requests_wait_for_the_reasoning():
    def params(parser: str, **body) -> dict:
        req = ChatRequest(messages=[{"role": "user", "content": "x"}], **body)
        out = {"json_schema": "{}"}
        _constrain_after_reasoning(SimpleNamespace(server_args=SimpleNamespace(reasoning_parser=parser)), req, out)
        return out
    assert params("deepseek-r1")["constrain_after"] == "</think>"
    assert params("qwen3")["constrain_after"] == "</think>"
    assert "constrain_after" not in params("qwen3", chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(RequestError, match="gpt-oss") as e:
        params("gpt-oss", response_format={"type": "json_object"})
    assert e.value.param == "response_format"
