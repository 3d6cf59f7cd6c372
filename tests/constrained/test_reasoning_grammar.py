"""Reasoning-aware grammars: free text until the end-of-reasoning marker, then the inner grammar,
on every backend (masks, EOS, the switch on a token boundary, jump-forward after it, copy)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from test_schema_fidelity import walk

from radixlang.constrained import FreeTextMasks, ReasoningGrammar, TokenizerInfo
from radixlang.kernels.bitmask import unpack_bitmask

BACKENDS = ("outlines", "xgrammar", "llguidance")
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 99}},
          "required": ["answer", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def info(smollm_tokenizer) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(smollm_tokenizer)


def _allowed(g, info) -> torch.Tensor:
    row = torch.zeros(info.num_words(), dtype=torch.int32)
    g.allowed_token_mask(row)
    return unpack_bitmask(row.unsqueeze(0), info.vocab_size)[0]


def _wrapped(compilers, backend: str, kind: str = "json", spec: str | None = json.dumps(SCHEMA)) -> ReasoningGrammar:
    c = compilers[backend]
    return ReasoningGrammar(c.compile(kind, spec).new_grammar(), c.free_text_masks("</think>"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_free_until_the_marker_then_the_schema(compilers, info, smollm_tokenizer, backend):
    g = _wrapped(compilers, backend)
    allowed = _allowed(g, info)
    assert not any(allowed[t] for t in info.eos_token_ids)  # a constrained reply must reach its constraint
    words = smollm_tokenizer.encode("Hmm, plain words and {not json", add_special_tokens=False)
    assert all(allowed[t] for t in words) and g.try_jump_forward() is None and not g.is_accepting()
    assert g.accept_text("Let me think about <this> and </thin k> it. </think>")
    assert not g.in_reasoning
    assert not g.copy().accept_text("More words")  # after the marker: the schema only
    assert (g.try_jump_forward() or "").startswith("{")  # jump-forward works after the switch
    text = walk(g, random.Random(0), explore_steps=12).decode()
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_switch_happens_on_a_token_boundary(compilers, info, smollm_tokenizer, backend):
    g = _wrapped(compilers, backend, "regex", r'"[a-z]+"')
    assert g.accept_text("ok </think")
    quote = smollm_tokenizer.convert_tokens_to_ids('>"')  # finishes the marker and goes on into the reply
    close = smollm_tokenizer.convert_tokens_to_ids(">")
    allowed = _allowed(g, info)
    assert allowed[close] and not allowed[quote]  # sampling never straddles the switch
    jumped = g.copy()  # but a retokenized jump-forward may: the rest goes to the inner grammar
    assert jumped.jump_forward_accept([quote]) and not jumped.in_reasoning and jumped.accept_text('abc"')
    assert jumped.is_accepting()
    bad = g.copy()
    assert not bad.jump_forward_accept([smollm_tokenizer.convert_tokens_to_ids(">,")]) and bad.in_reasoning
    assert g.accept_token(close) and not g.in_reasoning and not g.is_accepting()


def test_a_one_token_marker_and_copies(info, compilers):
    masks = FreeTextMasks(info, "</think>")
    assert len(masks.rows) == len("</think>")
    g = _wrapped(compilers, "llguidance")
    fork = g.copy()
    assert g.accept_text("x</think>") and fork.in_reasoning  # copies are independent
    with pytest.raises(ValueError, match="cannot spell"):
        FreeTextMasks(TokenizerInfo(vocab_size=3, eos_token_ids=[0], token_bytes=[None, b"a", b"b"]), "</think>")
