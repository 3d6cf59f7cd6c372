"""Call-block structural tags (what a tool_choice "auto" call compiles to) and forced tags with an
answer_schema (tools and a response_format together), on every backend that takes them."""

from __future__ import annotations

import json

import pytest

from radixlang.constrained import TokenizerInfo
from radixlang.constrained.errors import UnsupportedGrammar

ARGS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "n": {"type": "integer",
                                                                                    "minimum": 0, "maximum": 9}},
        "required": ["city", "n"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
         "additionalProperties": False}
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["Oslo", "Paris"]}}, "required": ["answer"],
          "additionalProperties": False}
LIBRARIES = ("xgrammar", "llguidance")


def _hermes(name: str, schema: dict) -> dict:
    return {"begin": f'<tool_call>\n{{"name": "{name}", "arguments": ', "schema": schema, "end": "}\n</tool_call>"}


def _json_call(name: str, schema: dict, key: str = "arguments") -> dict:
    return {"begin": f'{{"name": "{name}", "{key}": ', "schema": schema, "end": "}"}


def _block(**extra) -> str:
    return json.dumps({"type": "structural_tag", "triggers": ["<tool_call>"], "separator": "\n",
                       "structures": [_hermes("weather", ARGS), _hermes("clock", CLOCK)], **extra})


CALL = '<tool_call>\n{"name": "clock", "arguments": {"zone": "utc"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "n": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def info(smollm_tokenizer) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(smollm_tokenizer)


def _accepts(compiled, text: str) -> bool:
    g = compiled.new_grammar()
    return g.accept_text(text) and g.is_accepting()


def _takes(compiled, text: str) -> bool:
    """text is a prefix of something the grammar accepts."""
    return compiled.new_grammar().accept_text(text)


@pytest.mark.parametrize("backend", LIBRARIES)
def test_block_tag_holds_every_call_to_its_schema(compilers, backend):
    compiled = compilers[backend].compile("structural_tag", _block())
    assert _accepts(compiled, "")
    assert _accepts(compiled, "Just text, no call.")
    assert _accepts(compiled, f"Let me check.\n{CALL}")
    assert _accepts(compiled, f"{CALL}\n{CALL2}\nDone.")  # parallel: more calls, text between and after
    assert not _takes(compiled, "Hi <tool_call>\n{\"name\": \"unknown")  # only the tools' names
    assert not _takes(compiled, CALL.replace("utc", "pst"))  # the arguments' schema holds
    assert not _takes(compiled, "<tool_call>{\"zone\": 1}")  # the call's shape holds after the trigger
    assert not _takes(compiled, f"{CALL}\n<tool_call>oops")  # a later trigger opens a call again


@pytest.mark.parametrize("backend", LIBRARIES)
def test_block_tag_one_call_without_parallel(compilers, backend):
    compiled = compilers[backend].compile("structural_tag", _block(stop_after_first=True))
    assert _accepts(compiled, f"Checking. {CALL}")
    assert _accepts(compiled, "text only")
    assert not _takes(compiled, f"{CALL}\n{CALL2}")  # no second call: the call ends the reply
    assert not _takes(compiled, CALL.replace("utc", "pst"))
    assert not _takes(compiled, "<tool_call>\n{\"name\": \"clock\", \"arguments\": {\"zone\": 1")


@pytest.mark.parametrize("backend", LIBRARIES)
def test_block_tag_with_prefix_and_suffix(compilers, backend):
    """mistral's form: the trigger opens a list of calls joined by ", "."""
    tag = json.dumps({"type": "structural_tag", "triggers": ["[TOOL_CALLS]"], "prefix": "[TOOL_CALLS] [",
                      "separator": ", ", "suffix": "]",
                      "structures": [_json_call("weather", ARGS), _json_call("clock", CLOCK)]})
    compiled = compilers[backend].compile("structural_tag", tag)
    two = '[TOOL_CALLS] [{"name": "clock", "arguments": {"zone": "cet"}}, ' \
          '{"name": "weather", "arguments": {"city": "Paris", "n": 0}}]'
    assert _accepts(compiled, "ok " + two)
    assert _accepts(compiled, "plain")
    assert not _takes(compiled, '[TOOL_CALLS] [{"name": "clock", "arguments": {"zone": "x')
    assert not _takes(compiled, "[TOOL_CALLS] hello")


def test_bare_start_llama3(compilers):
    """llama3 calls as bare JSON opening the reply: held like those after <|python_tag|>."""
    tag = json.dumps({"type": "structural_tag", "triggers": ["<|python_tag|>"], "prefix": "<|python_tag|>",
                      "separator": "; ", "bare_start": True,
                      "structures": [_json_call("weather", ARGS, "parameters"),
                                     _json_call("clock", CLOCK, "parameters")]})
    compiled = compilers["llguidance"].compile("structural_tag", tag)
    assert _accepts(compiled, ' {"name": "clock", "parameters": {"zone": "utc"}}')
    assert _accepts(compiled, 'Sure: <|python_tag|>{"name": "clock", "parameters": {"zone": "cet"}}')
    assert _accepts(compiled, "No call {here} at all")
    assert not _takes(compiled, '{"name": "clock", "parameters": {"zone": 3')
    assert not _takes(compiled, '  {"answer": 1}')  # free text never opens with "{"
    with pytest.raises(UnsupportedGrammar, match="bare_start") as e:
        compilers["xgrammar"].compile("structural_tag", tag)
    assert e.value.param == "structural_tag"


def test_outlines_refuses_block_tags(compilers):
    with pytest.raises(UnsupportedGrammar, match="outlines"):
        compilers["outlines"].compile("structural_tag", _block())


@pytest.mark.parametrize("backend", ("outlines", *LIBRARIES))
def test_forced_tag_with_answer_schema(compilers, backend):
    """Tools and a response_format: the reply is a call or an answer in the format, each held."""
    tag = json.dumps({"type": "structural_tag", "forced": True, "separator": "\n", "stop_after_first": True,
                      "structures": [_hermes("weather", ARGS), _hermes("clock", CLOCK)], "answer_schema": ANSWER})
    compiled = compilers[backend].compile("structural_tag", tag)
    assert _accepts(compiled, CALL)
    assert _accepts(compiled, '{"answer": "Oslo"}')
    assert not _takes(compiled, "Sure")
    assert not _takes(compiled, '{"answer": "Rome')
    assert not _takes(compiled, CALL.replace("utc", "pst"))
    assert not _takes(compiled, f"{CALL}\n{CALL2}")  # one call (stop_after_first)


def test_shape_errors_name_the_field():
    from radixlang.constrained.structural_tag import parse_structural_tag
    with pytest.raises(UnsupportedGrammar, match="exactly one trigger"):
        parse_structural_tag({"triggers": ["<a>", "<b>"], "prefix": "<a>", "structures": [_hermes("f", {})]})
    with pytest.raises(UnsupportedGrammar, match="answer_schema needs forced"):
        parse_structural_tag({"triggers": ["<tool_call>"], "answer_schema": {}, "structures": [_hermes("f", {})]})
    with pytest.raises(UnsupportedGrammar, match="starts with none of the triggers"):
        parse_structural_tag({"triggers": ["<x>"], "separator": "", "structures": [_hermes("f", {})]})


# ---- every shipped tool-call format's auto-mode tag: a call opened by its trigger comes out valid ----
FAMILIES = ("hermes", "llama3", "mistral", "deepseekv3", "gpt-oss")
SCHEMAS = {"weather": ARGS, "clock": CLOCK}


def _parser(name: str):
    from radixlang.runtime.entrypoints.openai.tool_parsers import make_tool_parser
    return make_tool_parser(name, None, set(SCHEMAS))


@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
@pytest.mark.parametrize("family", FAMILIES)
def test_auto_tag_calls_parse_and_validate(compilers, family, parallel):
    """Random walks from text + the family's trigger: the parser reads back calls that validate."""
    import random

    import jsonschema
    from test_schema_fidelity import walk

    tag = _parser(family).auto_tag(list(SCHEMAS.items()), parallel=parallel)
    compiled = compilers["llguidance"].compile("structural_tag", json.dumps(tag))
    lead = "Let me look that up. " + tag["triggers"][0]
    if family == "gpt-oss":
        lead = "<|channel|>commentary " + tag["triggers"][0]
    seen = 0
    for seed in range(6):
        g = compiled.new_grammar()
        assert g.accept_text(lead)
        text = lead + walk(g, random.Random(seed)).decode("utf-8")
        calls = _parser(family).parse(text).calls
        assert calls, text  # the trigger opened a call the grammar saw through
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert parallel or len(calls) == 1
        seen += len(calls)
    assert seen >= 6


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_tag_refuses_a_call_off_its_schema(compilers, family):
    parser = _parser(family)
    tag = parser.auto_tag(list(SCHEMAS.items()), parallel=True)
    compiled = compilers["llguidance"].compile("structural_tag", json.dumps(tag))
    good = tag["prefix"] + parser.auto_call_begin("clock") + '{"zone": "utc"}'
    assert compiled.new_grammar().accept_text("ok " + good)
    assert not compiled.new_grammar().accept_text("ok " + good.replace("utc", "pst"))


def test_pythonic_has_no_auto_tag():
    assert _parser("pythonic").auto_tag(list(SCHEMAS.items()), parallel=True) is None


# ---- a trigger that is a special token of the tokenizer (Llama 3.1's <|python_tag|>): the token opens the call ----
PYTHON_TAG, EOM, TOOL_CALLS = "<|python_tag|>", "<|eom_id|>", "[TOOL_CALLS]"


@pytest.fixture(scope="module")
def special_compiler(smollm_tokenizer):
    """llguidance over SmolLM2's vocabulary plus special tokens (no bytes), as Llama 3.1's and Mistral's have."""
    from radixlang.constrained import GrammarCompiler
    vocab = smollm_tokenizer.get_vocab()
    size = max(vocab.values()) + 1
    added = {PYTHON_TAG: size, EOM: size + 1, TOOL_CALLS: size + 2}
    info = TokenizerInfo.from_vocab({**vocab, **added}, style="byte_level",
                                    eos_token_ids=[smollm_tokenizer.eos_token_id], special_tokens=set(added))
    assert info.special_ids == added  # by name; no bytes, so never text
    assert all(info.token_bytes[i] is None for i in added.values())
    compiler = GrammarCompiler(info, backend="llguidance", cache_size=8)
    yield compiler, info.special_ids
    compiler.shutdown()


def test_special_token_trigger_opens_a_held_call(special_compiler):
    import random

    import jsonschema
    from test_schema_fidelity import walk

    compiler, special = special_compiler
    tag = _parser("llama3").auto_tag(list(SCHEMAS.items()), parallel=False)
    compiled = compiler.compile("structural_tag", json.dumps(tag))
    g = compiled.new_grammar()
    assert g.accept_text("Let me check.")
    assert g.is_allowed(special[PYTHON_TAG]) and not g.is_allowed(special[EOM])  # the trigger, no other special
    assert not compiled.new_grammar().accept_text("Let me check. <|python_tag|>")  # not spelled out as text
    assert g.accept_token(special[PYTHON_TAG])
    assert not g.is_allowed(special[PYTHON_TAG]) and not g.is_accepting()
    head = '{"name": "'
    assert g.copy().accept_text(head + 'clock", "parameters": {"zone": "utc"}}')
    assert not g.copy().accept_text(head + 'clock", "parameters": {"zone": "pst"')  # the schema holds
    assert not g.copy().accept_text(head + 'nope')  # only the tools' names
    for seed in range(6):  # random walks after the token (no special token allowed): the call validates
        text = "Let me check." + PYTHON_TAG + walk(g.copy(), random.Random(seed)).decode("utf-8")
        (call,) = _parser("llama3").parse(text).calls
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_special_token_trigger_opens_each_parallel_block(special_compiler):
    compiler, special = special_compiler
    tag = _parser("llama3").auto_tag(list(SCHEMAS.items()), parallel=True)
    g = compiler.compile("structural_tag", json.dumps(tag)).new_grammar()
    assert g.accept_token(special[PYTHON_TAG])
    assert g.accept_text('{"name": "clock", "parameters": {"zone": "utc"}}; ')  # more calls in the block
    assert g.accept_text('{"name": "weather", "parameters": {"city": "Oslo", "n": 2}} then text ')
    assert g.is_accepting() and g.is_allowed(special[PYTHON_TAG])  # a later block opens at the token again
    assert g.accept_token(special[PYTHON_TAG])
    assert not g.copy().accept_text('{"name": "clock", "parameters": {"zone": 1')
    assert g.accept_text('{"name": "clock", "parameters": {"zone": "cet"}}') and g.is_accepting()


def test_special_token_trigger_text_only_and_mistral(special_compiler):
    compiler, special = special_compiler
    llama = compiler.compile("structural_tag", json.dumps(_parser("llama3").auto_tag(list(SCHEMAS.items()),
                                                                                     parallel=True)))
    assert _accepts(llama, "Plain text, no call.")  # free text ends the reply as it likes
    assert _accepts(llama, ' {"name": "clock", "parameters": {"zone": "cet"}}')  # bare_start still holds
    # mistral: the special token, then the rest of the prefix (" [") and the calls
    mistral = compiler.compile("structural_tag", json.dumps(_parser("mistral").auto_tag(list(SCHEMAS.items()),
                                                                                       parallel=True)))
    g = mistral.new_grammar()
    assert g.accept_text("ok ") and g.accept_token(special[TOOL_CALLS])
    assert not g.copy().accept_text(' [{"name": "clock", "arguments": {"zone": "pst"')
    assert g.accept_text(' [{"name": "clock", "arguments": {"zone": "utc"}}]') and g.is_accepting()
    assert not mistral.new_grammar().accept_text("ok [TOOL_CALLS] [")  # never spelled out as text


def test_a_trigger_the_tokenizer_has_as_text_stays_text(compilers):
    """SmolLM2 has no <|python_tag|> token: the same tag's trigger is written (and held) as text."""
    tag = _parser("llama3").auto_tag(list(SCHEMAS.items()), parallel=False)
    compiled = compilers["llguidance"].compile("structural_tag", json.dumps(tag))
    assert _accepts(compiled, 'ok <|python_tag|>{"name": "clock", "parameters": {"zone": "utc"}}')
    assert not _takes(compiled, 'ok <|python_tag|>{"name": "clock", "parameters": {"zone": "pst"')
