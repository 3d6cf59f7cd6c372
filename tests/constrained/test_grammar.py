"""Grammar state on tiny dict vocabularies: exact masks, transitions, EOS and jump-forward."""

from __future__ import annotations

import pytest
import torch

from radixlang.constrained import Grammar, GrammarCompiler, TokenizerInfo, pack_token_ids
from radixlang.kernels.bitmask import unpack_bitmask

VOCAB = {"a": 0, "b": 1, "ab": 2, "<eos>": 3}


def allowed_ids(grammar: Grammar) -> list[int]:
    info = grammar.compiled.tokenizer_info
    row = torch.zeros(info.num_words(), dtype=torch.int32)
    grammar.allowed_token_mask(row)
    return unpack_bitmask(row.unsqueeze(0), info.vocab_size)[0].nonzero().flatten().tolist()


@pytest.fixture()
def compiler():
    c = GrammarCompiler(TokenizerInfo.from_vocab(VOCAB, eos_token="<eos>"))
    yield c
    c.shutdown()


def test_masks_and_transitions_exact(compiler):
    g = Grammar(compiler.compile("regex", "a+b?"))
    assert allowed_ids(g) == [0, 2]           # "a" or "ab"; no "b", no EOS before a match
    assert not g.accept_token(1) and not g.accept_token(3)
    assert g.accept_token(0)                  # "a"
    assert allowed_ids(g) == [0, 1, 2, 3]     # more a, b, ab, or stop
    assert g.is_accepting()
    assert not g.is_complete()                # accepting, but more "a" may follow
    assert g.accept_token(1)                  # "ab": complete, nothing may follow
    assert allowed_ids(g) == [3]
    assert g.is_complete()
    assert not g.accept_token(0)
    assert g.accept_token(3)
    assert g.is_terminated() and not g.is_complete()
    assert allowed_ids(g) == [3]
    assert not g.accept_token(3) and not g.accept_token(0)


def test_rejected_token_leaves_state_unchanged(compiler):
    g = Grammar(compiler.compile("regex", "ab"))
    before = g.state
    assert not g.accept_token(1)
    assert g.state == before
    assert g.accept_token(2)
    assert allowed_ids(g) == [3]


def test_copy_is_independent(compiler):
    g = Grammar(compiler.compile("regex", "(a|b)b"))
    assert g.accept_token(0)
    h = g.copy()
    assert h.accept_token(1)
    assert allowed_ids(h) == [3]
    assert allowed_ids(g) == [1]


def test_jump_forward_tiny(compiler):
    g = Grammar(compiler.compile("regex", "abab(a|b)"))
    assert g.try_jump_forward() == "abab"
    assert g.jump_forward_accept([2, 0, 1])   # "ab" + "a" + "b"
    assert g.try_jump_forward() is None       # a or b: not forced
    assert allowed_ids(g) == [0, 1]


def test_jump_forward_accept_rejects_and_keeps_state(compiler):
    g = Grammar(compiler.compile("regex", "abab(a|b)"))
    before = g.state
    assert not g.jump_forward_accept([1])
    assert not g.jump_forward_accept([2, 2, 2, 2])
    assert g.state == before
    assert g.accept_text("aba")
    assert not g.accept_text("a")
    assert allowed_ids(g) == [1]


def test_no_jump_in_accepting_state(compiler):
    g = Grammar(compiler.compile("regex", "a(ab)?"))
    assert g.try_jump_forward() == "a"
    assert g.accept_token(0)
    assert g.try_jump_forward() is None      # EOS or "ab": two continuations


def test_padded_vocab_and_several_eos_ids():
    info = TokenizerInfo.from_vocab({"x": 0, "y": 1, "</s>": 2, "<end>": 3}, eos_token_ids=[2, 3], vocab_size=70)
    assert info.num_words() == 3
    c = GrammarCompiler(info)
    g = Grammar(c.compile("regex", "x+"))
    assert allowed_ids(g) == [0]
    assert g.accept_token(0)
    assert allowed_ids(g) == [0, 2, 3]
    assert not g.accept_token(69)             # padding id past the tokenizer: never allowed
    assert g.accept_token(3) and g.is_terminated()
    c.shutdown()


def test_mask_shape_checked(compiler):
    g = Grammar(compiler.compile("regex", "a"))
    with pytest.raises(ValueError, match="int32 tensor of shape"):
        g.allowed_token_mask(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        g.allowed_token_mask(torch.zeros(1, dtype=torch.int64))


def test_pack_token_ids_bit_layout():
    row = pack_token_ids([0, 31, 32, 33], 40)
    assert row.dtype == torch.int32 and row.shape == (2,)
    assert row[0].item() == (1 | -(1 << 31))  # bit 31 is the sign bit
    assert row[1].item() == 0b11
    assert unpack_bitmask(row.unsqueeze(0), 40)[0].nonzero().flatten().tolist() == [0, 31, 32, 33]


def test_multibyte_tokens_split_utf8():
    # "é" is b"\xc3\xa9": a token for each byte, and one for the whole character
    info = TokenizerInfo(vocab_size=4, eos_token_ids=[3], token_bytes=[b"\xc3", b"\xa9", "é".encode(), None])
    c = GrammarCompiler(info)
    g = Grammar(c.compile("regex", "é{2}"))
    assert allowed_ids(g) == [0, 2]
    assert g.try_jump_forward() == "éé"
    assert g.accept_token(0)                  # half a character
    assert g.try_jump_forward() is None       # forced bytes start mid-character: no text to hand out
    assert allowed_ids(g) == [1]
    assert g.jump_forward_accept([1, 2])
    assert allowed_ids(g) == [3]
    c.shutdown()
