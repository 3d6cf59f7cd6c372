"""POST /v1/messages (issue #41 item 2), driven by the official ``anthropic`` client against a live tiny-model
server started with --api-key: text, streaming events, forced tool calls and a tool_result turn, errors in
Anthropic's shape. The random model's text is compared with the chat route's greedy reply to the same turns."""
from __future__ import annotations

import json

import httpx
import pytest

from radixlang.runtime.entrypoints.anthropic_protocol import MessagesRequest, chat_body, stop_reason
from tests.live_server import live_server

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.e2e

KEY = "sk-test"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0}  # the client (2.10) has no temperature argument: sent in extra_body


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with live_server(tiny_model_dir, api_key=KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def _chat_text(server: str, messages: list[dict], max_tokens: int) -> dict:
    r = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_create_matches_the_chat_route(client, server):
    msg = client.messages.create(model="default", max_tokens=8, system="Be brief.", extra_body=GREEDY,
                                 messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
    chat = _chat_text(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], 8)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == chat["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert msg.stop_reason == ("max_tokens" if chat["choices"][0]["finish_reason"] == "length" else "end_turn")
    counted = client.messages.count_tokens(model="default", system="Be brief.",
                                           messages=[{"role": "user", "content": "Hello"}])
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_stream_events_and_text_match_create(client, server):
    kw = {"model": "default", "max_tokens": 10, "messages": [{"role": "user", "content": "Hi"}]}
    whole = client.messages.create(**kw, extra_body=GREEDY)
    with client.messages.stream(**kw, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    with httpx.stream("POST", server + "/v1/messages", json={**kw, **GREEDY, "stream": True}, timeout=60,
                      headers={"x-api-key": KEY}) as r:
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_use_then_a_tool_result_turn(client, choice):
    msg = client.messages.create(model="default", max_tokens=120, messages=ASK, tools=TOOLS, tool_choice=choice,
                                 extra_body=GREEDY)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and isinstance(uses[0].input, dict)
    if choice["type"] == "tool":
        assert uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    follow = client.messages.create(model="default", max_tokens=8, extra_body=GREEDY, tools=TOOLS, messages=[
        *ASK, {"role": "assistant", "content": msg.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use") and follow.content
    # the tool's result is in the prompt: a longer result is more prompt
    longer = client.messages.count_tokens(model="default", tools=TOOLS, messages=[
        *ASK, {"role": "assistant", "content": msg.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "Sunny, 21 C, light wind from the west"}]}])
    assert longer.input_tokens > follow.usage.input_tokens + (follow.usage.cache_read_input_tokens or 0)


def test_streamed_tool_use_sends_its_input_as_json_deltas(client, server):
    kw = {"model": "default", "max_tokens": 120, "messages": ASK, "tools": TOOLS,
          "tool_choice": {"type": "tool", "name": "get_weather"}}
    whole = client.messages.create(**kw, extra_body=GREEDY)
    with client.messages.stream(**kw, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in whole.content]
    with httpx.stream("POST", server + "/v1/messages", json={**kw, **GREEDY, "stream": True}, timeout=60,
                      headers={"x-api-key": KEY}) as r:
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert pieces and json.loads("".join(pieces)) == whole.content[0].input
    assert next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"


def test_prefill_continues_the_final_assistant_message(client):
    base = client.messages.count_tokens(model="default", messages=[{"role": "user", "content": "Count"}])
    filled = client.messages.count_tokens(model="default", messages=[
        {"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two, three"}])
    assert filled.input_tokens > base.input_tokens  # the prefill is in the prompt, after the generation prompt
    msg = client.messages.create(model="default", max_tokens=4, messages=[
        {"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two, three"}])
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == filled.input_tokens


def test_auth_accepts_x_api_key_and_bearer(server):
    body = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.post(server + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
    r = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(**body)


@pytest.mark.parametrize(("body", "field"), [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"name": "x"}]}, "tools.0.input_schema"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "temperature": 3}, "temperature"),
    ({"max_tokens": 4, "messages": ASK, "stop_sequences": "END"}, "stop_sequences"),
    ({"max_tokens": 4, "messages": ASK, "bogus": 1}, "bogus"),
    ({"max_tokens": 10 ** 7, "messages": ASK}, "max_tokens"),
])
def test_bad_input_is_a_400_in_anthropics_shape(server, body, field):
    r = httpx.post(server + "/v1/messages", json={"model": "default", **body}, headers={"x-api-key": KEY},
                   timeout=60)
    assert r.status_code == 400, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error", got
    assert field in got["error"]["message"], got


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_schema_the_grammar_refuses_names_tools(server, stream):
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {"s": {"type": "string",
                                                                                  "pattern": "(?<=a)b"}}}}]
    body = {"model": "default", "max_tokens": 8, "messages": ASK, "tools": tools, "tool_choice": {"type": "any"},
            "stream": stream}
    r = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    if stream:  # refused once the grammar compiles: the stream ends with an error event
        assert r.status_code == 200
        lines = r.text.splitlines()
        assert "event: error" in lines
        got = json.loads(lines[lines.index("event: error") + 1][len("data: "):])
    else:
        assert r.status_code == 400
        got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert got["error"]["message"].startswith("tools: "), got


def test_client_errors_raise_and_unknown_models_are_404(client):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="default", max_tokens=5000, messages=ASK)  # past the 2048 context
    with pytest.raises(anthropic.NotFoundError, match="claude-nope"):
        client.messages.create(model="claude-nope", max_tokens=4, messages=ASK)


def test_the_request_becomes_the_chat_routes_body():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Sys"}], "stop_sequences": ["END"],
        "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "Sunny"}]},
                                         {"type": "text", "text": "And tomorrow?"}]},
            {"role": "assistant", "content": "Tomorrow"}]})
    body, prefill = chat_body(req, native_tool_calls=True)
    assert prefill == "Tomorrow"
    assert body["messages"] == [
        {"role": "system", "content": "Sys"}, {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Sunny", "name": "get_weather"},
        {"role": "user", "content": "And tomorrow?"}]
    assert body["stop"] == ["END"] and body["max_tokens"] == 9
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["tools"][0]["function"] == {"name": "get_weather", "parameters": WEATHER,
                                            "description": "Weather of a city"}
    written, _ = chat_body(req, native_tool_calls=False)  # a template without tool calls: the call as text
    assert written["messages"][2] == {"role": "assistant", "content": 'Let me look.<tool_call>{"name": '
                                      '"get_weather", "arguments": {"city": "Paris"}}</tool_call>'}


@pytest.mark.parametrize(("finish", "tool_use", "want"), [
    ({"type": "length"}, False, ("max_tokens", None)),
    ({"type": "length"}, True, ("max_tokens", None)),  # a call cut short: its input is no JSON object yet
    ({"type": "stop", "matched": 2}, True, ("tool_use", None)),
    ({"type": "stop", "matched": 2}, False, ("end_turn", None)),
    ({"type": "stop", "matched": "END"}, False, ("stop_sequence", "END")),
    ({"type": "stop", "matched": "<|im_end|>"}, False, ("end_turn", None)),  # a stop string the client did not send
])
def test_stop_reason(finish, tool_use, want):
    out = {"meta_info": {"finish_reason": finish}}
    assert stop_reason(out, tool_use=tool_use, stop_sequences=["END"]) == want


def test_a_tool_loop_on_smollm2_gets_a_real_answer(smollm_path):
    """The embedded SmolLM2 through the whole loop: a forced call with the city the question names, then an
    answer that uses the tool's result (the tool_result turn reached the prompt)."""
    from fastapi.testclient import TestClient

    from radixlang import Engine
    from radixlang.runtime.entrypoints.engine_front import EngineFront
    from radixlang.runtime.entrypoints.http_server import create_app

    tools = [{"name": "get_weather", "description": "Get the current weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    engine = Engine(model_path=smollm_path, load_format="auto", max_total_tokens=4096)
    try:
        with TestClient(create_app(EngineFront(engine))) as c:
            forced = {"type": "tool", "name": "get_weather"}
            first = c.post("/v1/messages", json={"model": "default", "max_tokens": 60, **GREEDY, "messages": ask,
                                                 "tools": tools, "tool_choice": forced})
            assert first.status_code == 200, first.text
            use = first.json()["content"][0]
            assert use["type"] == "tool_use" and use["input"] == {"city": "Paris"}
            turn = [*ask, {"role": "assistant", "content": first.json()["content"]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                  "content": "Sunny, 21 degrees Celsius"}]}]
            final = c.post("/v1/messages", json={"model": "default", "max_tokens": 40, **GREEDY, "tools": tools,
                                                 "messages": turn})
            assert final.status_code == 200, final.text
            assert "21" in final.json()["content"][0]["text"]
    finally:
        engine.shutdown()
