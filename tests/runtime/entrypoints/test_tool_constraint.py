"""Which chat requests get their tool calls held to the tools' schemas, and the 400s for what cannot be
held (runtime/entrypoints/openai/tool_constraint.py)."""
from __future__ import annotations

import json

import pytest

from radixlang.constrained.structural_tag import parse_structural_tag
from radixlang.runtime.entrypoints.openai.chat_output import ChatOutput
from radixlang.runtime.entrypoints.openai.protocol import ChatRequest, active_tools, chat_constraint
from radixlang.runtime.entrypoints.openai.tool_constraint import (
    answer_constraint, answers_in_format, auto_call_constraint, holds_auto_calls,
)
from radixlang.runtime.errors import RequestError

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "x"}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}


def _req(**body) -> ChatRequest:
    return ChatRequest(messages=ASK, tools=TOOLS, **body)


def _probe(parser: str, req: ChatRequest) -> ChatOutput:
    return ChatOutput(tool_parser=parser, reasoning_parser=None, chat_template=None, tool_names={"get_time"},
                      forced=False, parallel=req.parallel_tool_calls is not False,
                      answer_format=answers_in_format(req, active_tools(req)))


def test_which_requests_hold_auto_calls():
    assert holds_auto_calls(_req(), active_tools(_req()), disabled=False)
    assert holds_auto_calls(_req(tool_choice="auto"), active_tools(_req()), disabled=False)
    assert not holds_auto_calls(_req(), active_tools(_req()), disabled=True)  # --disable-tool-call-constraint
    for body in ({"tool_choice": "none"}, {"tool_choice": "required"}, {"regex": "a+"}, {"response_format": FORMAT}):
        req = _req(**body)
        assert not holds_auto_calls(req, active_tools(req), disabled=False), body
    assert answers_in_format(_req(response_format=FORMAT), active_tools(_req()))
    assert answers_in_format(_req(response_format={"type": "json_object"}), active_tools(_req()))


@pytest.mark.parametrize("parser", ["hermes", "qwen25", "qwen3", "llama3", "mistral", "deepseekv3", "gpt-oss"])
def test_every_parser_with_a_trigger_gets_a_call_block(parser):
    req = _req(parallel_tool_calls=False)
    tag = parse_structural_tag(auto_call_constraint(_probe(parser, req), active_tools(req), tool_call_parser=parser,
                                                    chat_template=None, grammar_backend="llguidance"))
    assert tag.block and tag.stop_after_first and len(tag.triggers) == 1
    assert tag.bare_start == (parser == "llama3")


def test_a_format_without_a_start_marker_is_refused_naming_the_parser():
    req = _req()
    with pytest.raises(RequestError, match="pythonic") as e:
        auto_call_constraint(_probe("pythonic", req), active_tools(req), tool_call_parser="pythonic",
                             chat_template=None, grammar_backend="llguidance")
    assert e.value.param == "tool_choice" and "--disable-tool-call-constraint" in str(e.value)


def test_outlines_is_refused_naming_the_backend():
    req = _req()
    with pytest.raises(RequestError, match="outlines") as e:
        auto_call_constraint(_probe("hermes", req), active_tools(req), tool_call_parser="hermes",
                             chat_template=None, grammar_backend="outlines")
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize("parser", ["hermes", "pythonic"])
def test_tools_and_a_format_make_a_forced_tag_with_an_answer(parser):
    req = _req(response_format=FORMAT)
    tools = active_tools(req)
    probe = ChatOutput(tool_parser=parser, reasoning_parser=None, chat_template=None, tool_names={"get_time"},
                       forced=False, parallel=False, answer_format=True)
    kind, spec = answer_constraint(probe, tools, chat_constraint(req, tools))
    tag = parse_structural_tag(spec)
    assert kind == "structural_tag" and tag.forced and tag.stop_after_first
    assert tag.answer_schema == {"type": "object"}
    # the answer is content, a call is a call
    assert probe.message('{"a": 1}') == {"role": "assistant", "content": '{"a": 1}'}
    probe = ChatOutput(tool_parser=parser, reasoning_parser=None, chat_template=None, tool_names={"get_time"},
                       forced=False, parallel=False, answer_format=True)
    call = tag.structures[0].begin + "{}" + tag.structures[0].end
    (got,) = probe.message(call)["tool_calls"]
    assert got["function"]["name"] == "get_time" and json.loads(got["function"]["arguments"]) == {}


@pytest.mark.parametrize("parser,marker", [("llama3", "<|python_tag|>"), ("mistral", "[TOOL_CALLS]")])
def test_a_special_token_trigger_is_held_on_llguidance(parser, marker):
    """The trigger as a special token of the tokenizer: the call block opens at that token (llguidance)."""
    req = _req()
    tag = parse_structural_tag(auto_call_constraint(
        _probe(parser, req), active_tools(req), tool_call_parser=parser, chat_template=None,
        grammar_backend="llguidance", special={marker, "<|eot_id|>"}))
    assert tag.block and tag.triggers == (marker,) and tag.prefix.startswith(marker)


def test_a_special_token_trigger_on_xgrammar_is_refused_naming_the_backend():
    req = _req()
    with pytest.raises(RequestError, match=r"xgrammar.*<\|python_tag\|>.*--grammar-backend llguidance") as e:
        auto_call_constraint(_probe("llama3", req), active_tools(req), tool_call_parser="llama3", chat_template=None,
                             grammar_backend="xgrammar", special={"<|python_tag|>", "<|eot_id|>"})
    assert e.value.param == "tool_choice"


def test_special_token_markers_beyond_the_trigger_are_refused():
    """harmony writes special tokens inside each call and between calls: a call block takes one only as its
    trigger."""
    req = _req()
    harmony = {"<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|end|>", "<|return|>"}
    with pytest.raises(RequestError, match=r"gpt-oss.*<\|call\|>.*are special tokens") as e:
        auto_call_constraint(_probe("gpt-oss", req), active_tools(req), tool_call_parser="gpt-oss",
                             chat_template=None, grammar_backend="llguidance", special=harmony)
    assert e.value.param == "tool_choice" and "--disable-tool-call-constraint" in str(e.value)
    # hermes markers that are plain added tokens (Qwen's) are fine
    assert auto_call_constraint(_probe("hermes", req), active_tools(req), tool_call_parser="hermes",
                                chat_template=None, grammar_backend="llguidance", special={"<|im_end|>"})
