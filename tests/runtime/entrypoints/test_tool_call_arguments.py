"""A tool call whose arguments are not a JSON object is the model's text, not a call (issue #42 item 4),
whole and streamed; and the JSON-object prefix check that decides it while a call streams."""
from __future__ import annotations

import json

import pytest

from radixlang.runtime.entrypoints.openai.tool_parsers import make_tool_parser
from radixlang.runtime.entrypoints.openai.tool_parsers.json_prefix import is_json_object, object_prefix_ok

TOOLS = {"get_weather", "get_time"}
GOOD = '{"city": "Paris", "n": [1, -2.5e3, true, null, {"x": "a\\"b\\u00e9"}], "f": false, "e": {}}'
# arguments that are no object from their first characters: never shown as a call, whole or streamed
EARLY_BAD = ['"{...}"', "{...}", '"{\\"city\\": \\"Paris\\"}"', "[1, 2]"]
# arguments that go wrong later: no call in a whole reply; a stream stops the call's arguments there
LATE_BAD = ['{"city": Paris}', '{"a": 1,}']
BAD_ARGS = EARLY_BAD + LATE_BAD


def test_every_prefix_of_an_object_is_viable():
    for k in range(len(GOOD) + 1):
        assert object_prefix_ok(GOOD[:k]), GOOD[:k]
    assert is_json_object(GOOD) and is_json_object("  {} ")


@pytest.mark.parametrize("text", BAD_ARGS + ['{"a" 1}', '{"a": tru3}', '{"a": 01}', "{} x", '{"a": "\x01"}'])
def test_text_that_cannot_become_an_object(text):
    assert not object_prefix_ok(text)
    assert not is_json_object(text)


def _hermes(args: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'


def _stream(text: str, size: int) -> tuple[str, dict[int, list[str]]]:
    parser = make_tool_parser("hermes", None, TOOLS)
    content, calls = "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        delta = parser.parse_delta(piece, final=k == len(pieces) - 1)
        content += delta.content
        for e in delta.tool_calls:
            calls.setdefault(e["index"], [e["function"].get("name"), ""])[1] += e["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("args", BAD_ARGS)
def test_a_call_with_bad_arguments_is_content(args):
    text = "Sure. " + _hermes(args)
    result = make_tool_parser("hermes", None, TOOLS).parse(text)
    assert result.calls == [] and result.content == text
    for size in (1, 3, 64):
        _, calls = _stream(text, size)
        if args in EARLY_BAD:
            assert calls == {}, (size, calls)
        else:  # what was streamed of it stays a prefix that never closes into an object
            assert all(object_prefix_ok(a) and not is_json_object(a) for _, a in calls.values()), calls


def test_good_calls_around_a_bad_one_are_kept_with_their_indices():
    text = _hermes('{"city": "Oslo"}') + "\n" + _hermes("{...}") + "\n" + _hermes('{"city": "Rome"}')
    result = make_tool_parser("hermes", None, TOOLS).parse(text)
    assert [json.loads(c.arguments) for c in result.calls] == [{"city": "Oslo"}, {"city": "Rome"}]
    for size in (1, 2, 5):
        _, calls = _stream(text, size)
        assert {i: (n, json.loads(a)) for i, (n, a) in calls.items()} == {
            0: ("get_weather", {"city": "Oslo"}), 1: ("get_weather", {"city": "Rome"})}
