"""xgrammar and llguidance behind the shared per-request interface: kinds, EOS, padding, jump-forward,
copy, structural tags and EBNF; outlines refuses the kinds it can't do with a message naming them."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from test_schema_fidelity import walk

from radixlang.constrained import TokenizerInfo, UnsupportedGrammar
from radixlang.kernels.bitmask import unpack_bitmask

LIBRARIES = ("xgrammar", "llguidance")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TAG = {"type": "structural_tag", "triggers": ["<function="],
       "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
                      {"begin": "<function=get_time>", "schema": {"type": "object", "properties": {
                          "tz": {"enum": ["utc", "cet"]}}, "required": ["tz"]}, "end": "</function>"}]}
# GBNF: a list of 1-3 small sums; llguidance takes it converted to Lark, or Lark itself
GBNF = 'root ::= sum (";" sum){0,2}\nsum ::= num ("+" num)*\nnum ::= [1-9] [0-9]?\n'
GBNF_RE = r"[1-9][0-9]?(\+[1-9][0-9]?)*(;[1-9][0-9]?(\+[1-9][0-9]?)*){0,2}"
LARK = 'start: sum (";" sum)*\nsum: NUM ("+" NUM)*\nNUM: /[1-9][0-9]?/\n'


@pytest.fixture(scope="module")
def info(smollm_tokenizer) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(smollm_tokenizer, vocab_size=len(smollm_tokenizer) + 37)


def _allowed(g, info) -> torch.Tensor:
    row = torch.zeros(info.num_words(), dtype=torch.int32)
    g.allowed_token_mask(row)
    return unpack_bitmask(row.unsqueeze(0), info.vocab_size)[0]


@pytest.mark.parametrize("kind, spec", [("ebnf", GBNF), ("structural_tag", json.dumps(TAG))])
def test_outlines_refuses_kinds_it_cannot_do(compilers, kind, spec):
    with pytest.raises(UnsupportedGrammar, match=f"{kind} grammars are not supported by the outlines") as e:
        compilers["outlines"].compile(kind, spec)
    assert e.value.param == kind


@pytest.mark.parametrize("backend", LIBRARIES)
def test_ebnf_walks_match(compilers, backend):
    compiled = compilers[backend].compile("ebnf", GBNF)
    for seed in range(4):
        text = walk(compiled.new_grammar(), random.Random(seed), explore_steps=12).decode()
        assert re.fullmatch(GBNF_RE, text), text


def test_llguidance_takes_lark(compilers):
    compiled = compilers["llguidance"].compile("ebnf", LARK)
    for seed in range(3):
        text = walk(compiled.new_grammar(), random.Random(seed), explore_steps=12).decode()
        assert re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*(;[1-9][0-9]?(\+[1-9][0-9]?)*)*", text), text


@pytest.mark.parametrize("backend", LIBRARIES)
def test_invalid_ebnf_is_a_value_error(compilers, backend):
    with pytest.raises(ValueError, match=f"invalid ebnf grammar for {backend}"):
        compilers[backend].compile("ebnf", "root ::= undefined_rule")


@pytest.mark.parametrize("backend", LIBRARIES)
def test_structural_tag_free_text_then_body_then_free_text(compilers, info, backend):
    compiled = compilers[backend].compile("structural_tag", json.dumps(TAG))
    g = compiled.new_grammar()
    assert g.is_accepting()  # free text: EOS allowed at once
    assert g.accept_text("Let me check. <function=get_weather>")
    assert not g.is_accepting()  # inside the tag: the body and the end must come
    rng = random.Random(0)
    body = bytearray()
    while not body.endswith(b"</function>"):
        allowed = _allowed(g, info)
        assert not any(allowed[t] for t in info.eos_token_ids)
        forced = g.try_jump_forward()
        if forced:
            assert g.accept_text(forced)
            body += forced.encode()
            continue
        single = [t for t in allowed.nonzero().flatten().tolist() if len(info.token_bytes[t]) == 1]
        closers = [t for t in single if info.token_bytes[t] in (b'"', b"}")]
        t = rng.choice(closers or single)
        assert g.accept_token(t)
        body += info.token_bytes[t]
    doc = json.loads(bytes(body)[: -len(b"</function>")])
    assert set(doc) == {"city", "unit"} and doc["unit"] in ("c", "f") and len(doc["city"]) <= 10
    assert g.is_accepting() and g.accept_text(" Done.")
    assert g.accept_token(info.eos_token_ids[0]) and g.is_terminated()


@pytest.mark.parametrize("backend", LIBRARIES)
def test_structural_tag_refuses_a_bad_body(compilers, backend):
    g = compilers[backend].compile("structural_tag", json.dumps(TAG)).new_grammar()
    assert g.accept_text("<function=get_time>")
    assert not g.accept_text('{"tz": "pst"}')  # not in the enum: refused, state unchanged
    assert g.accept_text('{"tz": "utc"}</function>')


def test_structural_tag_spec_errors_name_the_field(compilers):
    bad = [{**TAG, "triggers": []}, {**TAG, "structures": [{"begin": "<tool>", "schema": {}, "end": "</tool>"}]},
           {**TAG, "extra": 1}, "not json"]
    for spec in bad:
        with pytest.raises(UnsupportedGrammar) as e:
            compilers["xgrammar"].compile("structural_tag", spec if isinstance(spec, str) else json.dumps(spec))
        assert e.value.param == "structural_tag"
    unenforced = {**TAG, "structures": [{"begin": "<function=f>", "end": "</function>",
                                         "schema": {"type": "array", "uniqueItems": True}}]}
    with pytest.raises(UnsupportedGrammar, match="uniqueItems.*xgrammar"):
        compilers["xgrammar"].compile("structural_tag", json.dumps(unenforced))


def test_equal_structural_tags_share_a_cache_entry(compilers):
    c = compilers["llguidance"]
    a = c.compile("structural_tag", json.dumps(TAG))
    b = c.compile("structural_tag", json.dumps(dict(reversed(list(TAG.items())))))
    assert a is b


@pytest.mark.parametrize("backend", LIBRARIES)
def test_eos_padding_and_termination(compilers, info, backend):
    g = compilers[backend].compile("regex", r"(yes|no)").new_grammar()
    allowed = _allowed(g, info)
    assert not allowed[len(info.token_bytes) - 37:].any()  # ids past the tokenizer: never
    assert not any(allowed[t] for t in info.eos_token_ids)  # not accepting yet
    eos = info.eos_token_ids[0]
    assert not g.accept_token(eos) and not g.is_terminated()
    assert g.accept_text("ye") and g.try_jump_forward() == "s"
    assert g.accept_text("s") and g.is_accepting() and g.is_complete()
    allowed = _allowed(g, info)
    assert allowed.nonzero().flatten().tolist() == sorted(info.eos_token_ids)
    assert g.accept_token(eos) and g.is_terminated()
    assert not g.accept_token(eos)
    assert _allowed(g, info).nonzero().flatten().tolist() == sorted(info.eos_token_ids)


@pytest.mark.parametrize("backend", LIBRARIES)
def test_copy_is_independent_and_jump_forward_is_all_or_nothing(compilers, smollm_tokenizer, backend):
    schema = {"type": "object", "properties": {"alpha_value": {"type": "integer"}, "beta": {"type": "boolean"}},
              "required": ["alpha_value", "beta"]}
    g = compilers[backend].compile("json", json.dumps(schema)).new_grammar()
    forced = g.try_jump_forward()
    assert forced and forced.startswith('{"alpha_value": ')
    ids = smollm_tokenizer.encode(forced, add_special_tokens=False)
    h = g.copy()
    assert h.jump_forward_accept(ids) and not h.is_accepting()
    assert g.try_jump_forward() == forced  # the original did not move
    bad = smollm_tokenizer.encode('{"beta": 1', add_special_tokens=False)
    assert not g.jump_forward_accept(bad) and g.try_jump_forward() == forced
    assert h.accept_text("12, ") and h.try_jump_forward() == '"beta": '


@pytest.mark.parametrize("backend", LIBRARIES)
def test_mask_agrees_with_accept_token(compilers, info, backend):
    g = compilers[backend].compile("json", json.dumps(WEATHER)).new_grammar()
    assert g.accept_text('{"city": "Pa')
    allowed = _allowed(g, info)
    rng = random.Random(1)
    for t in rng.sample(range(info.vocab_size), 300):
        assert g.copy().accept_token(t) == bool(allowed[t]), (t, info.token_bytes[t])
