"""What the grammar engine needs to know about a tokenizer: the bytes of every token.

A grammar is matched on bytes, so each token id is mapped to the exact bytes it
adds to the output. Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM2, Qwen)
spell bytes with the GPT-2 "byte to unicode" alphabet; SentencePiece vocabularies
(Llama 2, Mistral) spell a space as U+2581 and raw bytes as ``<0xNN>``.
Special tokens (and ids past the tokenizer's end, when the logits are padded)
get no bytes: a grammar never writes one as text. A named special token (Llama 3.1's
``<|python_tag|>``) is kept by name in ``special_ids``, so that a grammar that can
name tokens (llguidance) may allow it where a call opens; EOS ids are allowed only
where the grammar accepts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

TokenStyle = Literal["raw", "byte_level", "sentencepiece"]

_SPM_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPM_SPACE = "\u2581"


def gpt2_unicode_to_bytes() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable char -> byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = {b: b for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shift
            shift += 1
    return {chr(c): b for b, c in chars.items()}


def decode_token(token: str, style: TokenStyle, byte_map: dict[str, int] | None = None) -> bytes | None:
    """The bytes one vocabulary entry stands for, or None when it can't be spelled in bytes."""
    if style == "raw":
        return token.encode("utf-8")
    if style == "byte_level":
        if byte_map is None:
            raise ValueError("decode_token needs byte_map for the byte_level style, got None")
        try:
            return bytes(byte_map[c] for c in token)
        except KeyError:
            return None  # an added (non byte-level) token such as "<think>"
    m = _SPM_BYTE.match(token)
    if m:
        return bytes([int(m.group(1), 16)])
    return token.replace(_SPM_SPACE, " ").encode("utf-8")


@dataclass
class TokenizerInfo:
    """Per token id its bytes (None = never written as text), the logits width and the EOS ids.

    ``token_bytes`` has exactly ``vocab_size`` entries; ``single_byte_ids[b]`` is a
    token id that spells the single byte ``b`` (or -1), used by jump-forward;
    ``special_ids`` maps the name of each special token (no bytes, not EOS) to its id, and
    ``eos_names`` the name of each special token that is an EOS id (harmony's ``<|call|>``): a grammar
    never names one, it ends where that token may follow.
    """

    vocab_size: int
    eos_token_ids: list[int]
    token_bytes: list[bytes | None] = field(repr=False)
    single_byte_ids: list[int] = field(default_factory=list, repr=False)
    special_ids: dict[str, int] = field(default_factory=dict, repr=False)
    eos_names: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if len(self.token_bytes) != self.vocab_size:
            raise ValueError(f"token_bytes must have vocab_size={self.vocab_size} entries, got {len(self.token_bytes)}")
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token, got []")
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise ValueError(f"eos token id must be in [0, {self.vocab_size}), got {eos}")
        # EOS ends generation; it never spells output bytes
        for eos in self.eos_token_ids:
            self.token_bytes[eos] = None
        for name, token_id in self.special_ids.items():
            if not 0 <= token_id < self.vocab_size or self.token_bytes[token_id] is not None:
                raise ValueError(f"special_ids[{name!r}] must be a token id without bytes, got {token_id}")
        # EOS ends generation wherever the grammar accepts; a grammar never names it
        self.eos_names = {**self.eos_names,
                          **{n: i for n, i in self.special_ids.items() if i in self.eos_token_ids}}
        self.special_ids = {n: i for n, i in self.special_ids.items() if i not in self.eos_token_ids}
        if not self.single_byte_ids:
            single = [-1] * 256
            for i, b in enumerate(self.token_bytes):
                if b is not None and len(b) == 1 and single[b[0]] < 0:
                    single[b[0]] = i
            self.single_byte_ids = single

    @classmethod
    def from_vocab(cls, vocab: dict[str, int], *, eos_token_ids: list[int] | None = None,
                   eos_token: str | None = None, vocab_size: int | None = None,
                   style: TokenStyle = "raw", special_tokens: set[str] | None = None) -> TokenizerInfo:
        """From a {token_str: id} dict; ``style`` says how strings spell bytes ("raw" = UTF-8)."""
        if not vocab:
            raise ValueError("vocab must hold at least one token, got {}")
        size = max(vocab.values()) + 1
        if vocab_size is not None:
            if vocab_size < size:
                raise ValueError(f"vocab_size must cover the largest token id {size - 1}, got {vocab_size}")
            size = vocab_size
        eos_ids = list(eos_token_ids or [])
        if eos_token is not None:
            if eos_token not in vocab:
                raise ValueError(f"eos_token must be in the vocabulary, got {eos_token!r}")
            eos_ids.append(vocab[eos_token])
        if not eos_ids:
            raise ValueError("give eos_token_ids or eos_token")
        byte_map = gpt2_unicode_to_bytes() if style == "byte_level" else None
        special = special_tokens or set()
        token_bytes: list[bytes | None] = [None] * size
        special_ids: dict[str, int] = {}
        for token, token_id in vocab.items():
            if token in special:
                special_ids[token] = token_id
                continue
            data = decode_token(token, style, byte_map)
            token_bytes[token_id] = data if data else None
        return cls(vocab_size=size, eos_token_ids=sorted(set(eos_ids)), token_bytes=token_bytes,
                   special_ids=special_ids)

    @classmethod
    def from_tokenizer(cls, hf_tokenizer: Any, vocab_size: int | None = None, *,
                       eos_token_ids: list[int] | None = None) -> TokenizerInfo:
        """From a Hugging Face tokenizer; ``vocab_size`` is the logits width (>= len(tokenizer)).

        ``eos_token_ids`` (e.g. from the model's generation config) replaces the
        tokenizer's single eos_token_id.
        """
        vocab: dict[str, int] = hf_tokenizer.get_vocab()
        special = {t.content for t in getattr(hf_tokenizer, "added_tokens_decoder", {}).values() if t.special}
        special |= set(getattr(hf_tokenizer, "all_special_tokens", []))
        eos_ids: list[int] = list(eos_token_ids or [])
        eos = getattr(hf_tokenizer, "eos_token_id", None)
        if not eos_ids and isinstance(eos, int):
            eos_ids.append(eos)
        if not eos_ids:
            raise ValueError("the tokenizer must define eos_token_id, got None")
        return cls.from_vocab(vocab, eos_token_ids=eos_ids, vocab_size=vocab_size,
                              style=detect_style(vocab, hf_tokenizer), special_tokens=special)

    def num_words(self) -> int:
        """Width of one packed int32 bitmask row."""
        return (self.vocab_size + 31) // 32


def detect_style(vocab: dict[str, int], hf_tokenizer: Any = None) -> TokenStyle:
    """How a vocabulary spells bytes, from the tokenizer's decoder or its tokens."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    decoder = type(getattr(backend, "decoder", None)).__name__ if backend is not None else ""
    if decoder == "ByteLevel":
        return "byte_level"
    if any(_SPM_BYTE.match(t) for t in vocab) or any(_SPM_SPACE in t for t in vocab):
        return "sentencepiece"
    if "\u0120" in "".join(t for t in list(vocab)[:5000]):  # 'Ġ' = GPT-2's space
        return "byte_level"
    return "raw"
