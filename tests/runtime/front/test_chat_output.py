"""ChatOutput (reasoning parser, then tool-call parser), the special-token rule, and the new sampling params."""
from __future__ import annotations

import json

import pytest
import torch

from radixlang.runtime.entrypoints.openai.chat_output import ChatOutput, keep_special_markers
from radixlang.runtime.errors import RequestError
from radixlang.runtime.front.detokenizer import trim_at_stop_regex
from radixlang.runtime.sampling.sampler import apply_logit_bias
from radixlang.runtime.sampling.sampling_params import SamplingParams


def _out(**kw):
    base = dict(tool_parser="auto", reasoning_parser=None, chat_template=None, tool_names={"get_weather", "add"},
                forced=False, parallel=True)
    return ChatOutput(**{**base, **kw})


def test_reasoning_then_tool_call_whole_and_streamed():
    text = ('<think>Need the weather.</think>\n\nOn it.<tool_call>{"name": "get_weather", '
            '"arguments": {"city": "Nice"}}</tool_call>')
    msg = _out(reasoning_parser="qwen3").message(text)
    assert msg["reasoning_content"] == "Need the weather."
    assert msg["content"] == "On it."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Nice"})]
    out = _out(reasoning_parser="qwen3")
    got = {"reasoning_content": "", "content": "", "args": ""}
    for k in range(0, len(text), 4):
        d = out.delta(text[k:k + 4], final=k + 4 >= len(text))
        got["reasoning_content"] += d.get("reasoning_content", "")
        got["content"] += d.get("content", "")
        got["args"] += "".join(c["function"]["arguments"] for c in d.get("tool_calls", []))
    assert got == {"reasoning_content": "Need the weather.", "content": "On it.", "args": '{"city": "Nice"}'}
    assert out.has_calls


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
    assert len(_out().message(text)["tool_calls"]) == 2
    assert [c["function"]["arguments"] for c in _out(parallel=False).message(text)["tool_calls"]] == ['{"a": 1}']


def test_forced_call_streams_name_then_argument_pieces():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'  # the parser's own format
    out = _out(forced=True)
    entries = [e for k in range(0, len(text), 3) for e in out.delta(text[k:k + 3], final=k + 3 >= len(text))
               .get("tool_calls", [])]
    assert entries[0]["function"]["name"] == "add" and entries[0]["id"].startswith("call_")
    assert "".join(e["function"]["arguments"] for e in entries) == '{"a": 1, "b": 2}'
    assert len(entries) > 2


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral", "deepseekv3", "gpt-oss", "pythonic"])
def test_forced_tag_is_what_the_parser_reads(parser):
    """A reply written as the forced tag spells it parses, whole and streamed, into the calls."""
    from radixlang.constrained.structural_tag import parse_structural_tag

    out = _out(tool_parser=parser, forced=True)
    tag = parse_structural_tag(out.forced_tag([("get_weather", {"type": "object"}), ("add", {"type": "object"})]))
    assert tag.forced and not tag.stop_after_first
    by_name = {s.begin: s for s in tag.structures}
    calls = [("add", '{"a": 1}'), ("get_weather", '{"city": "Nice"}')]
    text = tag.prefix + tag.separator.join(
        next(s.begin + args + s.end for b, s in by_name.items() if name in b) for name, args in calls) + tag.suffix
    msg = out.message(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        (n, json.loads(a)) for n, a in calls], text
    streamed = _out(tool_parser=parser, forced=True)
    args: dict[int, str] = {}
    for k in range(0, len(text), 5):
        for e in streamed.delta(text[k:k + 5], final=k + 5 >= len(text)).get("tool_calls", []):
            args[e["index"]] = args.get(e["index"], "") + e["function"]["arguments"]
    assert [json.loads(a) for a in args.values()] == [json.loads(a) for _, a in calls]
    one = _out(tool_parser=parser, forced=True, parallel=False)
    assert parse_structural_tag(one.forced_tag([("add", {"type": "object"})])).stop_after_first


class _Tok:
    all_special_tokens = ["<|begin_of_text|>", "<|eot_id|>", "<|python_tag|>"]
    added_tokens_decoder: dict = {}


def test_special_token_markers_are_kept_and_other_special_tokens_dropped():
    out = _out(tool_parser="llama3")
    keep, drop = keep_special_markers(out, _Tok())
    assert keep and set(drop) == {"<|begin_of_text|>", "<|eot_id|>"}
    msg = _out(tool_parser="llama3", drop=drop).message(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>')
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    assert keep_special_markers(_out(tool_parser="hermes"), _Tok()) == (False, ())


def test_logit_bias_and_stop_regex_validation():
    p = SamplingParams(logit_bias={"5": 2.5, 7: -100}, stop_regex=r"\d+")
    assert p.logit_bias_ids == [(5, 2.5), (7, -100.0)] and p.stop_regex == [r"\d+"]
    for bad in ({"-1": 1}, {"a": 1}, {"3": 100.5}, {"3": True}, [1, 2]):
        with pytest.raises(RequestError) as e:
            SamplingParams(logit_bias=bad)
        assert e.value.param == "logit_bias"
    with pytest.raises(RequestError) as e:
        SamplingParams(stop_regex=["(open"])
    assert e.value.param == "stop_regex"


def test_apply_logit_bias_adds_per_row():
    logits = torch.zeros(2, 6)
    apply_logit_bias(logits, [SamplingParams(logit_bias={"1": 3.0, "4": -2.0}), SamplingParams()])
    assert logits.tolist() == [[0, 3, 0, 0, -2, 0], [0] * 6]


@pytest.mark.parametrize("text,pattern,start,want", [
    ("abc 123 def", r"\d+", 0, "abc "), ("abc 123 def", r"\d+", 5, "abc 1"), ("no digits", r"\d", 0, "no digits"),
])
def test_trim_at_stop_regex(text, pattern, start, want):
    assert trim_at_stop_regex(text, pattern, start) == want


class _TemplateTok:
    chat_template = None

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt, chat_template=None, **kw):
        import jinja2
        return jinja2.Template(chat_template).render(messages=messages, **kw)


def test_history_tool_calls_reach_a_template_that_renders_them():
    from radixlang.runtime.entrypoints.openai.protocol import ChatRequest, chat_prompt
    tpl = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
           "[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
           "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %};{% endfor %}")
    req = ChatRequest.model_validate({"messages": [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}], "chat_template_kwargs": {"x": 1}})
    want = 'user:w?;assistant:[get_weather {"city": "Rome"}];tool:sunny(c1);'
    assert chat_prompt(_TemplateTok(), req, [], tpl) == want
    bad = ChatRequest.model_validate({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]})
    with pytest.raises(RequestError) as e:
        chat_prompt(_TemplateTok(), bad, [], tpl)
    assert e.value.param == "messages"


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral", "pythonic"])
def test_a_template_without_tools_is_told_the_parsers_call_format(parser):
    from radixlang.runtime.entrypoints.openai.protocol import ChatRequest, Tool, chat_prompt
    from radixlang.runtime.entrypoints.openai.tool_parsers import TOOL_PARSERS
    tpl = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    tool = Tool.model_validate({"type": "function", "function": {"name": "get_weather"}})
    prompt = chat_prompt(_TemplateTok(), req, [tool], tpl, call_format=TOOL_PARSERS[parser].example)
    assert prompt.startswith("system:You may call these functions:") and '"get_weather"' in prompt
    assert TOOL_PARSERS[parser].example in prompt
