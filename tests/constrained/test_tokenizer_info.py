"""TokenizerInfo: token bytes for raw, byte-level and SentencePiece vocabularies, and SmolLM2."""

from __future__ import annotations

import pytest

from radixlang.constrained import TokenizerInfo
from radixlang.constrained.tokenizer_info import gpt2_unicode_to_bytes


def test_gpt2_alphabet_is_a_bijection():
    table = gpt2_unicode_to_bytes()
    assert sorted(table.values()) == list(range(256))
    assert table["\u0120"] == ord(" ") and table["\u010a"] == ord("\n") and table["a"] == ord("a")


def test_byte_level_vocab():
    vocab = {"\u0120hi": 0, "\u010a": 1, "\u00c3\u00a9": 2, "<|end|>": 3, "x": 4}
    info = TokenizerInfo.from_vocab(vocab, eos_token="<|end|>", style="byte_level", special_tokens={"<|end|>"})
    assert info.token_bytes == [b" hi", b"\n", "é".encode(), None, b"x"]
    assert info.single_byte_ids[ord("\n")] == 1 and info.single_byte_ids[ord("x")] == 4
    assert info.single_byte_ids[ord("q")] == -1


def test_sentencepiece_vocab():
    vocab = {"<unk>": 0, "</s>": 1, "\u2581hi": 2, "<0x0A>": 3, "<0xC3>": 4, "lo": 5}
    info = TokenizerInfo.from_vocab(vocab, eos_token="</s>", style="sentencepiece", special_tokens={"<unk>"})
    assert info.token_bytes == [None, None, b" hi", b"\n", b"\xc3", b"lo"]


def test_padding_ids_and_errors():
    info = TokenizerInfo.from_vocab({"a": 0, "<eos>": 1}, eos_token="<eos>", vocab_size=33)
    assert info.vocab_size == 33 and info.num_words() == 2
    assert info.token_bytes[2:] == [None] * 31
    with pytest.raises(ValueError, match="vocab_size must cover"):
        TokenizerInfo.from_vocab({"a": 0, "b": 5}, eos_token="b", vocab_size=3)
    with pytest.raises(ValueError, match="eos_token must be in the vocabulary"):
        TokenizerInfo.from_vocab({"a": 0}, eos_token="<eos>")
    with pytest.raises(ValueError, match="token_bytes must have"):
        TokenizerInfo(vocab_size=3, eos_token_ids=[0], token_bytes=[b"a"])


def test_smollm2_bytes_round_trip(smollm_tokenizer, smollm_info):
    assert smollm_info.vocab_size == len(smollm_tokenizer)
    assert smollm_info.eos_token_ids == [smollm_tokenizer.eos_token_id]
    text = 'Héllo wörld\n{"key": [1, 2]}\t日本語 🙂'
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(smollm_info.token_bytes[i] for i in ids) == text.encode("utf-8")
    for token_id in smollm_tokenizer.all_special_ids:
        assert smollm_info.token_bytes[token_id] is None
    assert sum(b is None for b in smollm_info.token_bytes) == len(smollm_tokenizer.added_tokens_decoder)


def test_smollm2_padded_logits_width_and_eos_override(smollm_tokenizer):
    info = TokenizerInfo.from_tokenizer(smollm_tokenizer, vocab_size=len(smollm_tokenizer) + 64,
                                        eos_token_ids=[0, 2])
    assert info.vocab_size == len(smollm_tokenizer) + 64
    assert info.token_bytes[-64:] == [None] * 64
    assert info.eos_token_ids == [0, 2]
