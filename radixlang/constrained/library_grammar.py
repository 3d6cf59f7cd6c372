"""Grammars run by a library matcher (xgrammar, llguidance) behind the outlines Grammar's interface.

A ``MatcherCompiled`` is the shared compiled grammar of one (kind, spec); a
``MatcherGrammar`` wraps one library matcher per request and adds what the
scheduler relies on everywhere: the radixlang EOS rule (EOS only in accepting
states; after it only EOS), the packed int32 mask of ``tokenizer_info.vocab_size``
words (ids past the tokenizer's own vocabulary and tokens without bytes are
never allowed, except the special tokens an llguidance grammar names), jump-forward
text and ``copy``. Subclasses adapt one library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlang.constrained.grammar import pack_token_ids, utf8_prefix_len
from radixlang.constrained.tokenizer_info import TokenizerInfo


def spellable_mask(info: TokenizerInfo, *, named_special: bool = False) -> torch.Tensor:
    """Packed row allowing the tokens that have bytes plus the EOS ids (what any grammar may allow), and
    with ``named_special`` the special tokens too (for a library whose grammars can name them)."""
    ids = [i for i, b in enumerate(info.token_bytes) if b]
    extra = [*info.eos_token_ids, *(info.special_ids.values() if named_special else ())]
    return pack_token_ids(ids, info.vocab_size, extra_ids=extra)


@dataclass(eq=False)
class MatcherCompiled:
    """One backend's compiled grammar and the tokenizer it was compiled for."""

    backend: str
    kind: str
    spec: str | None
    handle: Any  # the library's compiled grammar
    tokenizer_info: TokenizerInfo
    grammar_cls: type[MatcherGrammar] = field(repr=False, default=None)  # type: ignore[assignment]
    base_mask: torch.Tensor = field(repr=False, default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.eos_token_ids: frozenset[int] = frozenset(self.tokenizer_info.eos_token_ids)
        self.eos_mask = pack_token_ids(sorted(self.eos_token_ids), self.tokenizer_info.vocab_size)

    def new_grammar(self) -> MatcherGrammar:
        return self.grammar_cls(self)


class MatcherGrammar:
    """Per-request state over a MatcherCompiled (same contract as constrained.grammar.Grammar)."""

    def __init__(self, compiled: MatcherCompiled, matcher: Any = None) -> None:
        self.compiled = compiled
        self.matcher = matcher if matcher is not None else self._new_matcher()
        self._terminated = False
        self._mask: torch.Tensor | None = None  # the mask of the current state, once computed

    # ---- library adapters (subclasses) -----------------------------------------------
    def _new_matcher(self) -> Any:
        raise NotImplementedError

    def _fork(self) -> Any:
        raise NotImplementedError

    def _fill(self, row: torch.Tensor) -> None:
        """Write the library's mask of the current state into a CPU int32 row."""
        raise NotImplementedError

    def _accept(self, token_id: int) -> bool:
        """Advance by a non-EOS token; False (state unchanged) when it isn't allowed."""
        raise NotImplementedError

    def _accepting(self) -> bool:
        raise NotImplementedError

    def _forced_bytes(self) -> bytes:
        raise NotImplementedError

    # ---- the interface --------------------------------------------------------------
    def current_mask(self) -> torch.Tensor:
        """The packed mask of the current state (computed once per state; do not modify)."""
        if self._terminated:
            return self.compiled.eos_mask
        if self._mask is None:
            row = torch.zeros(self.compiled.tokenizer_info.num_words(), dtype=torch.int32)
            self._fill(row)
            row &= self.compiled.base_mask
            eos = self.compiled.eos_mask
            row &= ~eos
            if self._accepting():
                row |= eos
            self._mask = row
        return self._mask

    def allowed_token_mask(self, into: torch.Tensor) -> None:
        """Fill ``into`` ([ceil(vocab_size / 32)] int32, any device) with the allowed tokens."""
        num_words = self.compiled.tokenizer_info.num_words()
        if into.dtype != torch.int32 or into.shape != (num_words,):
            raise ValueError(f"into must be an int32 tensor of shape ({num_words},), "
                             f"got {into.dtype} {tuple(into.shape)}")
        into.copy_(self.current_mask(), non_blocking=True)

    def is_allowed(self, token_id: int) -> bool:
        return self._bit(self.current_mask(), token_id)

    def _in_base_mask(self, token_id: int) -> bool:
        return self._bit(self.compiled.base_mask, token_id)

    def _bit(self, mask: torch.Tensor, token_id: int) -> bool:
        if not 0 <= token_id < self.compiled.tokenizer_info.vocab_size:
            return False
        return bool((int(mask[token_id // 32]) >> (token_id % 32)) & 1)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when it isn't allowed."""
        if self._terminated:
            return False
        if token_id in self.compiled.eos_token_ids:
            if not self._accepting():
                return False
            self._terminated, self._mask = True, None
            return True
        if not self._in_base_mask(token_id):  # no bytes and not a special token the library may name
            return False
        if not self._accept(token_id):
            return False
        self._mask = None
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def is_accepting(self) -> bool:
        return not self._terminated and self._accepting()

    def is_complete(self) -> bool:
        """A complete match that nothing but EOS can extend."""
        if self._terminated or not self._accepting():
            return False
        return bool(torch.equal(self.current_mask(), self.compiled.eos_mask))

    def try_jump_forward(self) -> str | None:
        if self._terminated or self._accepting():
            return None
        data = self._forced_bytes()
        cut = utf8_prefix_len(data)
        return data[:cut].decode("utf-8") if cut else None

    def jump_forward_accept(self, token_ids: Sequence[int]) -> bool:
        """Advance by all of ``token_ids`` or (False) not at all."""
        if self._terminated:
            return False
        trial = self.copy()
        for t in token_ids:
            if t in self.compiled.eos_token_ids or not trial.accept_token(t):
                return False
        self.matcher, self._mask = trial.matcher, None
        return True

    def accept_text(self, text: str | bytes) -> bool:
        """Advance by raw text (byte by byte through single-byte tokens); False, unchanged, if it leaves."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        if self._terminated:
            return not data
        single = self.compiled.tokenizer_info.single_byte_ids
        ids = [single[b] for b in data]
        if any(t < 0 for t in ids):
            return False
        return self.jump_forward_accept(ids)

    def copy(self) -> MatcherGrammar:
        other = type(self)(self.compiled, self._fork())
        other._terminated = self._terminated
        other._mask = self._mask
        return other
