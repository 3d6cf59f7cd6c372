"""Reasoning-aware grammars: free text until the end-of-reasoning marker, then the request's grammar.

``ReasoningGrammar`` wraps any per-request grammar state (every backend's) behind the same
interface. While the reply is reasoning, any token with bytes may follow except EOS (a
constrained reply must reach its constrained part) and tokens that would finish the marker
before their last byte: the text after the marker belongs to the inner grammar, so the switch
happens on a token boundary. The marker is matched on bytes (KMP), so it may be one token
(Qwen3's ``</think>``) or spelled by several. After the switch every call goes to the inner
grammar: masks, EOS, jump-forward.

``FreeTextMasks`` holds the packed masks of the reasoning part, one per marker state (how much of
the marker the reply ends with); build it once per (tokenizer, marker) and share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixlang.constrained.grammar import pack_token_ids
from radixlang.constrained.state import GrammarState
from radixlang.constrained.tokenizer_info import TokenizerInfo


class FreeTextMasks:
    """The reasoning part's masks for one marker: ``rows[k]`` when the reply ends with marker[:k]."""

    def __init__(self, info: TokenizerInfo, marker: str) -> None:
        if not marker:
            raise ValueError("the end-of-reasoning marker must be non-empty")
        self.info = info
        self.marker = marker.encode("utf-8")
        self._delta = _kmp_table(self.marker)
        m = self.marker
        spelled = [t for t, b in enumerate(info.token_bytes) if b]
        if not self.spellable():
            raise ValueError(f"the tokenizer cannot spell the end-of-reasoning marker {marker!r}")
        # only a token holding the marker's last byte before its own last byte can finish it too early
        suspects = [t for t in spelled if m[-1:] in info.token_bytes[t][:-1]]  # type: ignore[index]
        self.rows: list[torch.Tensor] = []
        for k in range(len(m)):
            early = {t for t in suspects if self._finishes_early(k, info.token_bytes[t])}  # type: ignore[arg-type]
            self.rows.append(pack_token_ids([t for t in spelled if t not in early], info.vocab_size))

    def spellable(self) -> bool:
        """Whether some token sequence spells the marker (byte by byte, or one token with exactly its bytes)."""
        single = self.info.single_byte_ids
        return all(single[b] >= 0 for b in self.marker) or self.marker in set(self.info.token_bytes)

    def step(self, k: int, byte: int) -> int:
        """The marker state after ``byte`` (len(marker): the marker is complete)."""
        return self._delta[k][byte]

    def _finishes_early(self, k: int, data: bytes) -> bool:
        for byte in data[:-1]:
            k = self._delta[k][byte]
            if k == len(self.marker):
                return True
        return False


def _kmp_table(m: bytes) -> list[list[int]]:
    """delta[k][byte]: the longest prefix of m that the text ends with, after text ending with m[:k] + byte."""
    delta = [[0] * 256 for _ in range(len(m))]
    delta[0][m[0]] = 1
    fallback = 0
    for k in range(1, len(m)):
        delta[k] = list(delta[fallback])
        delta[k][m[k]] = k + 1
        fallback = delta[fallback][m[k]]
    return delta


class ReasoningGrammar:
    """A grammar state that starts in free reasoning text and switches to ``inner`` after the marker."""

    def __init__(self, inner: GrammarState, masks: FreeTextMasks, matched: int | None = 0) -> None:
        self.inner = inner
        self.masks = masks
        self.matched = matched  # marker bytes the reasoning ends with; None once the marker is complete

    @property
    def compiled(self) -> Any:
        return self.inner.compiled

    @property
    def in_reasoning(self) -> bool:
        return self.matched is not None

    def allowed_token_mask(self, into: torch.Tensor) -> None:
        if self.matched is None:
            self.inner.allowed_token_mask(into)
        else:
            into.copy_(self.masks.rows[self.matched], non_blocking=True)

    def accept_token(self, token_id: int) -> bool:
        if self.matched is None:
            return self.inner.accept_token(token_id)
        info = self.masks.info
        if token_id in info.eos_token_ids or not 0 <= token_id < info.vocab_size:
            return False
        data = info.token_bytes[token_id]
        return bool(data) and self._advance(data)  # type: ignore[arg-type]

    def accept_text(self, text: str | bytes) -> bool:
        data = text.encode("utf-8") if isinstance(text, str) else text
        if self.matched is None:
            return self.inner.accept_text(data)
        return self._advance(data)

    def _advance(self, data: bytes) -> bool:
        """Walk reasoning bytes; past the marker's end the rest goes to the inner grammar (all or nothing)."""
        if self.matched is None:
            raise RuntimeError("_advance walks the reasoning marker; the reasoning part has already ended")
        k, end = self.matched, len(self.masks.marker)
        for i, byte in enumerate(data):
            k = self.masks.step(k, byte)
            if k == end:
                rest = data[i + 1:]
                inner = self.inner.copy()
                if rest and not inner.accept_text(rest):
                    return False
                self.inner, self.matched = inner, None
                return True
        self.matched = k
        return True

    def is_terminated(self) -> bool:
        return self.matched is None and self.inner.is_terminated()

    def is_accepting(self) -> bool:
        return self.matched is None and self.inner.is_accepting()

    def is_complete(self) -> bool:
        return self.matched is None and self.inner.is_complete()

    def try_jump_forward(self) -> str | None:
        return None if self.matched is not None else self.inner.try_jump_forward()

    def jump_forward_accept(self, token_ids: Sequence[int]) -> bool:
        if self.matched is None:
            return self.inner.jump_forward_accept(token_ids)
        trial = self.copy()
        if not all(trial.accept_token(t) for t in token_ids):
            return False
        self.inner, self.matched = trial.inner, trial.matched
        return True

    def copy(self) -> ReasoningGrammar:
        return ReasoningGrammar(self.inner.copy(), self.masks, self.matched)
