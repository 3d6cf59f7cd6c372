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


HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")


def test_harmony_markers_as_special_tokens_make_a_harmony_tag():
    """gpt-oss writes special tokens inside each call and between calls: on llguidance the free text becomes
    harmony messages framed by them (refused with a 400 before); on xgrammar a 400 naming llguidance."""
    req = _req()
    tag = parse_structural_tag(auto_call_constraint(
        _probe("gpt-oss", req), active_tools(req), tool_call_parser="gpt-oss", chat_template=None,
        grammar_backend="llguidance", special=set(HARMONY)))
    assert tag.harmony and tag.block and tag.separator == "<|start|>assistant"
    assert [s.begin for s in tag.structures] == ["to=functions.get_time <|constrain|>json<|message|>"]
    with pytest.raises(RequestError, match=r"xgrammar.*<\|call\|>.*--grammar-backend llguidance") as e:
        auto_call_constraint(_probe("gpt-oss", req), active_tools(req), tool_call_parser="gpt-oss",
                             chat_template=None, grammar_backend="xgrammar", special=set(HARMONY))
    assert e.value.param == "tool_choice"
    # harmony markers that are plain text: the text-trigger block, as for any other format
    plain = parse_structural_tag(auto_call_constraint(
        _probe("gpt-oss", req), active_tools(req), tool_call_parser="gpt-oss", chat_template=None,
        grammar_backend="llguidance"))
    assert not plain.harmony


def test_special_token_markers_beyond_the_trigger_are_refused():
    """Another format whose markers inside the calls are special tokens: a call block takes one only as its
    trigger."""
    req = _req()
    deepseek = {"<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                "<｜tool▁calls▁end｜>"}
    with pytest.raises(RequestError, match=r"deepseekv3.*are special tokens") as e:
        auto_call_constraint(_probe("deepseekv3", req), active_tools(req), tool_call_parser="deepseekv3",
                             chat_template=None, grammar_backend="llguidance", special=deepseek)
    assert e.value.param == "tool_choice" and "--disable-tool-call-constraint" in str(e.value)
    # hermes markers that are plain added tokens (Qwen's) are fine
    assert auto_call_constraint(_probe("hermes", req), active_tools(req), tool_call_parser="hermes",
                                chat_template=None, grammar_backend="llguidance", special={"<|im_end|>"})


# ---- the harmony grammar (constrained/harmony_lark.py) on a dict vocabulary: every byte, a few words, and
# harmony's markers as special tokens, <|call|> and <|return|> EOS ids as gpt-oss lists them ----
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
         "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}


@pytest.fixture(scope="module")
def harmony():
    from radixlang.constrained import GrammarCompiler
    from radixlang.constrained.tokenizer_info import TokenizerInfo
    from radixlang.runtime.entrypoints.openai.tool_parsers.gpt_oss import GptOssParser
    vocab = {chr(b): b for b in range(32, 127)} | {"\n": 10}
    for word in ("analysis", "commentary", "final", "assistant", "to=functions.", "json", " the"):
        vocab[word] = len(vocab) + 200
    ids = {name: 400 + i for i, name in enumerate(HARMONY)}
    info = TokenizerInfo.from_vocab({**vocab, **ids}, eos_token_ids=[ids["<|call|>"], ids["<|return|>"]],
                                    special_tokens=set(HARMONY))
    assert set(info.eos_names) == {"<|call|>", "<|return|>"} and "<|call|>" not in info.special_ids
    compiler = GrammarCompiler(info, backend="llguidance", cache_size=4)
    names = {i: n for n, i in ids.items()}
    yield compiler, ids, names, GptOssParser
    compiler.shutdown()


def _harmony_grammar(harmony, *, parallel: bool):
    compiler, ids, names, parser = harmony
    return compiler.compile("structural_tag", json.dumps(parser(set(SCHEMAS)).harmony_tag(
        list(SCHEMAS.items()), parallel=parallel))).new_grammar()


def _feed(g, ids: dict, *parts: str) -> bool:
    """Advance by text and markers (a part that is a marker name is its token)."""
    return all(g.accept_token(ids[p]) if p in ids else g.accept_text(p) for p in parts)


def test_harmony_grammar_holds_a_commentary_call(harmony):
    _, ids, _, _ = harmony
    g = _harmony_grammar(harmony, parallel=True)
    call = ("<|channel|>", "commentary to=functions.get_time ", "<|constrain|>", "json", "<|message|>")
    assert _feed(g, ids, "<|channel|>", "analysis", "<|message|>", "Look it up.", "<|end|>", "<|start|>",
                 "assistant", *call, '{"zone": "utc"}')
    # <|call|> is an EOS id: the call's JSON ends the reply, only EOS may follow (the scheduler stops there)
    assert g.is_complete() and g.is_allowed(ids["<|call|>"])
    assert not _feed(_harmony_grammar(harmony, parallel=True), ids, *call, '{"zone": "pst"}')  # the schema
    assert not _feed(_harmony_grammar(harmony, parallel=True), ids, "<|channel|>", "commentary to=functions.nope")
    # a recipient only where a call begins; no body spells a marker out as text
    assert not _feed(_harmony_grammar(harmony, parallel=True), ids, "<|channel|>", "final to=functions.")
    assert not _feed(_harmony_grammar(harmony, parallel=True), ids, "<|channel|>", "final", "<|message|>",
                     "Hi<|end|>")


def test_harmony_grammar_free_messages(harmony):
    _, ids, _, _ = harmony
    g = _harmony_grammar(harmony, parallel=False)
    assert not g.is_accepting() and g.is_allowed(ids["<|channel|>"]) and not g.is_allowed(ids["<|start|>"])
    assert _feed(g, ids, "<|channel|>", "analysis", "<|message|>", "Think.")
    assert g.is_accepting() and g.is_allowed(ids["<|end|>"])  # EOS (<|return|>) or the next message
    assert _feed(g, ids, "<|end|>")
    assert not g.is_accepting() and not g.is_allowed(ids["<|channel|>"])  # <|start|>assistant first
    assert _feed(g, ids, "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Sunny.")
    assert g.is_accepting()


def _walk(g, names: dict, rng) -> str:
    """Tokens drawn from the mask (a marker a third of the time when one is allowed) until EOS or a
    finished grammar; the text as the detokenizer writes it, EOS left out."""
    info = g.compiled.tokenizer_info
    out = []
    for _ in range(400):
        if g.is_complete():
            break
        allowed = [t for t in range(info.vocab_size) if g.is_allowed(t)]
        marks = [t for t in allowed if t in names]
        token = rng.choice(marks if marks and rng.random() < 0.35 else allowed)
        assert g.accept_token(token)
        if token in info.eos_token_ids:
            break
        out.append(names.get(token) or info.token_bytes[token].decode())
    return "".join(out)


@pytest.mark.parametrize("parallel", [False, True])
def test_harmony_grammar_walks_parse_and_validate(harmony, parallel):
    """Random walks through the grammar: every call the gpt-oss parsers read back validates, and the
    reasoning parser finds the analysis messages."""
    import random

    import jsonschema

    from radixlang.runtime.entrypoints.openai.reasoning_parser import make_reasoning_parser
    _, _, names, parser = harmony
    num_calls = 0
    for seed in range(40):
        text = _walk(_harmony_grammar(harmony, parallel=parallel), names, random.Random(seed))
        split = make_reasoning_parser("gpt-oss").parse(text)
        calls = parser(set(SCHEMAS)).parse(split.rest).calls
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert len(calls) <= 1  # <|call|> is an EOS id: the first call ends the reply
        num_calls += len(calls)
    assert num_calls >= 5


def test_a_harmony_call_cut_before_its_arguments_is_no_call():
    """The last message needs no end marker (<|call|> is an EOS id the text leaves out), but a call whose
    arguments never began was cut off by the token limit: no call with empty arguments."""
    from radixlang.runtime.entrypoints.openai.tool_parsers.gpt_oss import GptOssParser
    head = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
    assert GptOssParser({"get_time"}).parse(head).calls == []
    (call,) = GptOssParser({"get_time"}).parse(head + '{"zone": "utc"}').calls
    assert call.arguments == '{"zone": "utc"}'
    (call,) = GptOssParser({"get_time"}).parse(head + "<|call|>").calls  # an empty call, ended: as before
    assert call.arguments == ""


def test_harmony_grammar_with_call_as_a_special_token(harmony):
    """A tokenizer whose <|call|> is no EOS id (another generation config): the grammar names it after each
    call, and with several calls allowed the next message follows it."""
    from radixlang.constrained import GrammarCompiler
    from radixlang.constrained.tokenizer_info import TokenizerInfo
    compiler, ids, _, parser = harmony
    base = compiler.tokenizer_info
    info = TokenizerInfo(vocab_size=base.vocab_size, eos_token_ids=[ids["<|return|>"]],
                         token_bytes=list(base.token_bytes),
                         special_ids={**base.special_ids, "<|call|>": ids["<|call|>"]})
    other = GrammarCompiler(info, backend="llguidance", cache_size=4)
    try:
        call = ("<|channel|>", "commentary to=functions.get_time ", "<|constrain|>", "json", "<|message|>",
                '{"zone": "utc"}', "<|call|>")
        for parallel in (False, True):
            g = other.compile("structural_tag", json.dumps(parser(set(SCHEMAS)).harmony_tag(
                list(SCHEMAS.items()), parallel=parallel))).new_grammar()
            assert _feed(g, ids, *call[:-1]) and not g.is_accepting()  # <|call|> must follow
            assert _feed(g, ids, "<|call|>") and g.is_accepting()
            assert _feed(g.copy(), ids, "<|start|>", "assistant", *call) == parallel
    finally:
        other.shutdown()
