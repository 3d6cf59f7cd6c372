"""The OpenAI-compatible routes, driven by the official openai client against a live tiny-model server."""
from __future__ import annotations

import json

import httpx
import pytest


openai = pytest.importorskip("openai")
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


def test_chat_n2_usage_and_logprobs(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "Hello"}],
                                          max_tokens=4, temperature=0, n=2, logprobs=True, top_logprobs=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    assert chat.usage.prompt_tokens_details.cached_tokens < chat.usage.prompt_tokens
    again = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                    {"role": "user", "content": "Hello"}],
                                           max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_completions_batch_stop_seed(client):
    comp = client.completions.create(model="tiny", prompt=["Once upon", "a time"], max_tokens=3, n=2,
                                     temperature=1.0, seed=7, logprobs=1)
    assert sorted(c.index for c in comp.choices) == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in comp.choices)
    seeded = [client.completions.create(model="tiny", prompt="Seeds", max_tokens=5, seed=3).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=2)
    assert ids.usage.prompt_tokens == 4


@pytest.mark.parametrize("chat", [True, False])
def test_streaming_matches_non_streaming(client, chat):
    kw = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream_options": {"include_usage": True}}
    if chat:
        kw["messages"] = [{"role": "user", "content": "Stream please"}]
        full = client.chat.completions.create(**{k: v for k, v in kw.items() if k != "stream_options"})
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = full.choices[0].message.content
    else:
        kw["prompt"] = "Stream please"
        full = client.completions.create(**{k: v for k, v in kw.items() if k != "stream_options"})
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = full.choices[0].text
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stream_ends_with_done_and_n2(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
            "stream": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def _constrained(client, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Give JSON"}],
                                          max_tokens=64, temperature=0, **kw)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["city", "n"]}


def test_json_schema_response_format(client):
    out = _constrained(client, response_format={"type": "json_schema",
                                                "json_schema": {"name": "place", "schema": SCHEMA}})
    obj = json.loads(out.choices[0].message.content)
    assert set(obj) == {"city", "n"} and 0 <= obj["n"] <= 9
    out = _constrained(client, response_format={"type": "json_object", "schema": SCHEMA})  # llama.cpp's form
    assert set(json.loads(out.choices[0].message.content)) == {"city", "n"}
    # any object: a random model may keep writing one long string; what it ends is an object
    out = _constrained(client, response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert out.choices[0].finish_reason == "length"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather for a city",
                                            "parameters": SCHEMA}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tools_forced_calls(client, choice):
    out = _constrained(client, tools=[WEATHER, CLOCK], tool_choice=choice)
    msg = out.choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.content is None
    call = msg.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if isinstance(choice, dict):
        assert call.function.name == "get_time" and args["zone"] in ("utc", "cet")
    else:
        assert call.function.name in ("get_weather", "get_time")


def test_tools_auto_returns_a_valid_message(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                         max_tokens=4, temperature=0, tools=[WEATHER])
    msg = out.choices[0].message
    assert (msg.content is None) == bool(msg.tool_calls)


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "regex": "a+", "json_schema": "{}"}, "regex"),
])
def test_chat_errors_name_the_field(server, body, param):
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[10 ** 9], max_tokens=2)
    assert client.models.list().data[0].object == "model"
