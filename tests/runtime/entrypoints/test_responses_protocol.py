"""/v1/responses without a model: input items as chat messages, the chat body, the bounded store."""
from __future__ import annotations

import pytest

from radixlang.runtime.entrypoints.openai.responses_protocol import (
    ResponsesRequest, chat_body, function_tools, input_messages,
)
from radixlang.runtime.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from radixlang.runtime.errors import RequestError


def test_items_become_chat_messages_with_calls_joined_to_their_turn():
    calls: dict[str, str] = {}
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "be "}, {"type": "input_text",
                                                                                       "text": "brief"}]},
             {"type": "message", "role": "user", "content": "weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]}]
    messages = input_messages(items, known_calls=calls)
    assert messages == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon", "name": "get_time"}]
    assert calls == {"c1": "get_weather", "c2": "get_time"}
    assert input_messages("hi", known_calls={}) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("item", [
    {"type": "item_reference", "id": "x"},
    {"role": "tool", "content": "x"},
    {"type": "function_call", "name": "f", "arguments": "{}"},
    {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
])
def test_unserved_items_name_the_input(item):
    with pytest.raises(RequestError) as e:
        input_messages([item], known_calls={})
    assert e.value.param == "input" and "input[0]" in str(e.value)


def test_chat_body_maps_the_responses_fields():
    req = ResponsesRequest.model_validate({
        "input": "x", "max_output_tokens": 9, "temperature": 0.5, "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
        "include": ["message.output_text.logprobs"], "top_logprobs": 3, "stream": True})
    body = chat_body(req, [{"role": "user", "content": "x"}], function_tools(req))
    assert body["max_tokens"] == 9 and body["temperature"] == 0.5
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                                "strict": True}}]
    assert "response_format" not in body  # the forced call is the reply
    assert body["logprobs"] is True and body["top_logprobs"] == 3
    assert body["stream_options"] == {"include_usage": True}
    free = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "json_schema", "name": "out",
                                                                              "schema": {"type": "object"}}}})
    assert chat_body(free, [], [])["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "out", "schema": {"type": "object"}}}


def test_store_is_bounded_least_recently_used_first():
    store = ResponseStore(capacity=2)
    item = StoredResponse({}, [], {})
    store.put("a", item)
    store.put("b", item)
    assert store.get("a") is item  # a is now the most recently used
    store.put("c", item)
    assert store.get("b") is None and store.get("a") is item and store.get("c") is item and len(store) == 2
    assert store.delete("a") and not store.delete("a")
