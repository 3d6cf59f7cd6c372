"""Forced structural tags (what a forced tool call compiles to) on every backend, and
--constrained-json-whitespace-pattern taking effect on every backend or being refused by name."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from test_schema_fidelity import walk

from radixlang.constrained import GrammarCompiler, TokenizerInfo
from radixlang.constrained.schema_policy import check_whitespace_pattern
from radixlang.runtime.server_args import ServerArgs

BACKENDS = ("outlines", "xgrammar", "llguidance")
ARGS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "n": {"type": "integer",
                                                                                    "minimum": 0, "maximum": 9}},
        "required": ["city", "n"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
         "additionalProperties": False}


def _hermes(name: str, schema: dict) -> dict:
    return {"begin": f'<tool_call>\n{{"name": "{name}", "arguments": ', "schema": schema, "end": "}\n</tool_call>"}


def _tag(**extra) -> str:
    return json.dumps({"type": "structural_tag", "forced": True, "separator": "\n",
                       "structures": [_hermes("weather", ARGS), _hermes("clock", CLOCK)], **extra})


ONE = '<tool_call>\n{"name": "clock", "arguments": {"zone": "utc"}}\n</tool_call>'
TWO = ONE + '\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "n": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def info(smollm_tokenizer) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(smollm_tokenizer)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_tag_allows_only_calls(compilers, backend):
    compiled = compilers[backend].compile("structural_tag", _tag())
    g = compiled.new_grammar()
    assert not g.is_accepting()  # no free text, no empty reply
    assert g.try_jump_forward() == '<tool_call>\n{"name": "'
    assert not g.copy().accept_text("Sure! ")
    assert not g.copy().accept_text(ONE.replace("utc", "pst"))  # the arguments' schema holds
    one = g.copy()
    assert one.accept_text(ONE) and one.is_accepting()
    if backend != "outlines":  # outlines-core's index drops byte-by-byte steps into a repeated group
        two = g.copy()
        assert two.accept_text(TWO) and two.is_accepting()
    assert not g.copy().accept_text(ONE + " and more text")


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_tag_walks_parse_into_valid_calls(compilers, backend):
    compiled = compilers[backend].compile("structural_tag", _tag())
    schemas = {"weather": ARGS, "clock": CLOCK}
    for seed in range(3):
        text = walk(compiled.new_grammar(), random.Random(seed), explore_steps=16).decode()
        blocks = [b for b in text.split("\n</tool_call>") if b]
        assert blocks and text.endswith("</tool_call>")
        for block in blocks:
            call = json.loads(block.strip().removeprefix("<tool_call>\n"))
            jsonschema.validate(call["arguments"], schemas[call["name"]])


@pytest.mark.parametrize("backend", ("xgrammar", "llguidance"))
def test_forced_tag_stop_after_first_and_prefix_suffix(compilers, backend):
    g = compilers[backend].compile("structural_tag", _tag(stop_after_first=True)).new_grammar()
    assert g.copy().accept_text(ONE) and not g.copy().accept_text(TWO)
    tag = {"type": "structural_tag", "forced": True, "prefix": "[TOOL_CALLS] [", "separator": ", ", "suffix": "]",
           "structures": [{"begin": '{"name": "clock", "arguments": ', "schema": CLOCK, "end": "}"}]}
    g = compilers[backend].compile("structural_tag", json.dumps(tag)).new_grammar()
    h = g.copy()
    assert h.accept_text('[TOOL_CALLS] [{"name": "clock", "arguments": {"zone": "cet"}}, '
                         '{"name": "clock", "arguments": {"zone": "utc"}}]') and h.is_accepting()
    assert not g.copy().accept_text('{"name"')


def test_outlines_still_refuses_free_text_tags(compilers):
    tag = {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [_hermes("clock", CLOCK)]}
    with pytest.raises(ValueError, match="structural_tag grammars are not supported by the outlines"):
        compilers["outlines"].compile("structural_tag", json.dumps(tag))


SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {
    "type": "integer"}}}, "required": ["a", "b"]})
COMPACT, SPACED, LOOSE = '{"a":1,"b":[2,3]}', '{ "a": 1, "b": [ 2, 3 ] }', '{\n  "a":\t1,\r\n"b":[]}'


@pytest.mark.parametrize("backend, pattern, accepted, refused", [
    ("outlines", "", [COMPACT], [SPACED, LOOSE]),
    ("outlines", "[ ]?", [COMPACT, SPACED], [LOOSE]),
    ("outlines", "[ \t\n\r]*", [COMPACT, SPACED, LOOSE], []),
    ("llguidance", "", [COMPACT], [SPACED, LOOSE]),
    ("llguidance", "[ ]?", [COMPACT, SPACED], [LOOSE]),
    ("llguidance", "[ \t\n\r]*", [COMPACT, SPACED, LOOSE], []),
    ("xgrammar", "", [COMPACT], [SPACED, LOOSE]),
    ("xgrammar", "[ \t\n\r]*", [COMPACT, SPACED, LOOSE], []),
    ("xgrammar", "[ \t\n\r]{0,1}", [COMPACT, SPACED], [LOOSE]),
])
def test_whitespace_pattern_takes_effect(info, backend, pattern, accepted, refused):
    c = GrammarCompiler(info, backend=backend, whitespace_pattern=pattern)
    try:
        g = c.compile("json", SCHEMA).new_grammar()
        for doc in accepted:
            h = g.copy()
            assert h.accept_text(doc) and h.is_accepting(), (backend, pattern, doc)
        for doc in refused:
            h = g.copy()
            assert not (h.accept_text(doc) and h.is_accepting()), (backend, pattern, doc)
    finally:
        c.shutdown()


@pytest.mark.parametrize("pattern", ["[ ]?", r"\s*", " "])
def test_xgrammar_refuses_patterns_it_cannot_write(info, pattern):
    with pytest.raises(ValueError, match="xgrammar grammar backend cannot use"):
        GrammarCompiler(info, backend="xgrammar", whitespace_pattern=pattern)
    with pytest.raises(ValueError, match="xgrammar"):  # at start: the server's arguments
        ServerArgs(grammar_backend="xgrammar", constrained_json_whitespace_pattern=pattern)
    for backend in ("outlines", "llguidance"):
        assert check_whitespace_pattern(backend, pattern) == {}
    with pytest.raises(ValueError, match="not a valid regex"):
        ServerArgs(constrained_json_whitespace_pattern="(open")
