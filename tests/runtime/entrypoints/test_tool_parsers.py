"""Tool-call and reasoning parsers on real transcripts of each format, whole and streamed in small pieces."""
from __future__ import annotations

import json

import pytest

from radixlang.runtime.entrypoints.openai.reasoning_parser import make_reasoning_parser
from radixlang.runtime.entrypoints.openai.tool_parsers import detect, make_tool_parser

TOOLS = {"get_weather", "get_time", "add"}

# (parser, transcript as the model wrote it, expected content, expected [(name, arguments as parsed JSON)])
GOLDEN = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "Europe/Paris"})]),
    ("qwen25", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3], "note": "x < y } {"}}\n</tool_call>',
     None, [("add", {"a": 1, "b": [2, 3], "note": "x < y } {"})]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco"}}; '
               '{"name": "get_time", "parameters": {"tz": "PST"}}',
     None, [("get_weather", {"city": "San Francisco"}), ("get_time", {"tz": "PST"})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 3}}',
     None, [("get_weather", {"city": "Tokyo", "days": 3})]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
                '{"name": "add", "arguments": {"a": 2.5, "b": -1}}]',
     "Sure.", [("get_weather", {"city": "Lyon"}), ("add", {"a": 2.5, "b": -1})]),
    ("deepseekv3", 'I will look it up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                   '```json\n{"city": "Beijing"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                   'get_time\n```json\n{"tz": "Asia/Shanghai"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "I will look it up.", [("get_weather", {"city": "Beijing"}), ("get_time", {"tz": "Asia/Shanghai"})]),
    ("pythonic", '[get_weather(city="Paris", days=2), add(a=1, b=[2, 3], flag=True)]',
     None, [("get_weather", {"city": "Paris", "days": 2}), ("add", {"a": 1, "b": [2, 3], "flag": True})]),
    ("gpt-oss", '<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|><|start|>assistant'
                '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>',
     None, [("get_weather", {"city": "Oslo"})]),
    ("gpt-oss", '<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final'
                '<|message|>Hello! How can I help?<|return|>', "Hello! How can I help?", []),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("llama3", "The answer is 4.", "The answer is 4.", []),
]


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def _stream(name: str, text: str, size: int):
    parser = make_tool_parser(name, None, TOOLS)
    content, calls = "", {}
    pieces = _pieces(text, size)
    for k, piece in enumerate(pieces):
        delta = parser.parse_delta(piece, final=k == len(pieces) - 1)
        content += delta.content
        for entry in delta.tool_calls:
            if entry["index"] not in calls:  # the first chunk of a call: id, type, name and its arguments so far
                assert entry["id"].startswith("call_") and entry["type"] == "function"
                assert entry["function"]["name"]
                calls[entry["index"]] = [entry["function"]["name"], entry["function"]["arguments"]]
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                calls[entry["index"]][1] += entry["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in range(len(calls))]


@pytest.mark.parametrize("name,text,content,expected", GOLDEN, ids=[f"{g[0]}-{i}" for i, g in enumerate(GOLDEN)])
def test_whole_parse(name, text, content, expected):
    result = make_tool_parser(name, None, TOOLS).parse(text)
    assert result.content == (content if content is not None or result.calls else "")
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == expected
    assert len({c.id for c in result.calls}) == len(result.calls)


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize("name,text,content,expected", GOLDEN, ids=[f"{g[0]}-{i}" for i, g in enumerate(GOLDEN)])
def test_streamed_pieces_match_whole(name, text, content, expected, size):
    streamed_content, calls = _stream(name, text, size)
    assert (streamed_content.strip() or None) == content
    assert [(n, json.loads(a)) for n, a in calls] == expected


def test_stream_emits_text_before_a_call_and_holds_back_only_a_possible_marker():
    parser = make_tool_parser("hermes", None, TOOLS)
    assert parser.parse_delta("Checking the weather").content == "Checking the weather"
    assert parser.parse_delta(" now <tool").content == " now "  # "<tool" may begin <tool_call>
    delta = parser.parse_delta('_call>\n{"name": "get_weather", "arguments": {"city": ')
    assert delta.content == ""
    assert delta.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    delta = parser.parse_delta('"Rome"}}\n</tool_call>')
    assert delta.tool_calls == [{"index": 0, "function": {"arguments": '"Rome"}'}}]


def test_unknown_tool_names_are_not_reported():
    result = make_tool_parser("hermes", None, {"get_time"}).parse(
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')
    assert result.calls == []


@pytest.mark.parametrize("template,name", [
    ("{% for m in messages %}<tool_call>{% endfor %}", "hermes"),
    ("{{'<|python_tag|>'}}", "llama3"), ("[TOOL_CALLS]", "mistral"),
    ("<｜tool▁calls▁begin｜><think>", "deepseekv3"), ("<|start|><|channel|>", "gpt-oss"),
    ("<|python_start|>", "pythonic"), ("plain {{ messages }}", "hermes"), (None, "hermes"),
])
def test_detect_from_chat_template(template, name):
    assert detect(template) == name


REASONING = [
    ("deepseek-r1", "Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2+2 is 4.\n", "The answer is 4."),
    ("deepseek-r1", "<think>Hmm.</think>Yes.", "Hmm.", "Yes."),
    ("deepseek-r1", "still thinking, no end", "still thinking, no end", ""),
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "Hello!"),
    ("qwen3", "Hello without thinking.", "", "Hello without thinking."),
    ("gpt-oss", "<|channel|>analysis<|message|>Think it over.<|end|><|start|>assistant<|channel|>final<|message|>"
                "Done.<|return|>", "Think it over.", "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"),
]


@pytest.mark.parametrize("size", [1, 3, 5, 1000])
@pytest.mark.parametrize("name,text,reasoning,rest", REASONING)
def test_reasoning_split_whole_and_streamed(name, text, reasoning, rest, size):
    whole = make_reasoning_parser(name).parse(text)
    assert (whole.reasoning, whole.rest) == (reasoning, rest)
    parser = make_reasoning_parser(name)
    got_r, got_c = "", ""
    pieces = _pieces(text, size)
    for k, piece in enumerate(pieces):
        d = parser.parse_delta(piece, final=k == len(pieces) - 1)
        got_r, got_c = got_r + d.reasoning, got_c + d.rest
    assert (got_r, got_c) == (reasoning, rest)


def test_gpt_oss_reasoning_then_tool_call_through_both_parsers():
    text = GOLDEN[7][1]
    split = make_reasoning_parser("gpt-oss").parse(text)
    assert split.reasoning == "The user wants the weather; call the tool."
    calls = make_tool_parser("gpt-oss", None, TOOLS).parse(split.rest).calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
