"""A compiled grammar (shared, immutable index + mask cache) and its per-request state."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from outlines_core import Index

from radixlang.constrained.tokenizer_info import TokenizerInfo

MAX_JUMP_BYTES = 4096


def pack_token_ids(token_ids: Sequence[int], vocab_size: int, *, extra_ids: Sequence[int] = (),
                   drop_ids: Sequence[int] = ()) -> torch.Tensor:
    """Token ids (+ extra_ids - drop_ids) -> packed bitmask row: bit i % 32 of word i // 32 set = token i allowed.

    Ids at or past vocab_size are ignored.
    """
    num_words = (vocab_size + 31) // 32
    allowed = torch.zeros(num_words * 32 + 1, dtype=torch.bool)  # last slot: sink for ids >= vocab_size
    for ids, value in ((token_ids, True), (extra_ids, True), (drop_ids, False)):
        if len(ids):
            index = torch.as_tensor(ids, dtype=torch.int64).clamp_(max=vocab_size)
            allowed[index] = value
    allowed = allowed[: num_words * 32]
    allowed[vocab_size:] = False
    shifts = torch.arange(32, dtype=torch.int64)
    words = (allowed.view(num_words, 32).to(torch.int64) << shifts).sum(dim=1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)  # [num_words] int32 cpu


@dataclass(eq=False)
class CompiledGrammar:
    """The token index of one (kind, spec), shared by all requests that use it.

    Thread-safe: the caches are filled under a lock; the index is read-only.
    """

    kind: str
    spec: str | None
    regex: str
    index: Index
    tokenizer_info: TokenizerInfo
    _masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _forced: dict[int, tuple[bytes, list[int]]] = field(default_factory=dict, repr=False)
    _complete: dict[int, bool] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.initial_state: int = self.index.get_initial_state()
        self.eos_token_ids: frozenset[int] = frozenset(self.tokenizer_info.eos_token_ids)

    def new_grammar(self) -> Grammar:
        """A fresh per-request state (every backend's compiled grammar has this)."""
        return Grammar(self)

    def is_final(self, state: int) -> bool:
        return bool(self.index.is_final_state(state))

    def next_state(self, state: int, token_id: int) -> int | None:
        """The state after ``token_id`` (not EOS), or None when it isn't allowed."""
        if token_id in self.eos_token_ids:
            return None
        nxt = self.index.get_next_state(state, token_id)
        return None if nxt is None else int(nxt)

    def advance_bytes(self, state: int, data: bytes) -> int | None:
        """Walk ``data`` byte by byte (through single-byte tokens); None when it leaves the grammar."""
        single = self.tokenizer_info.single_byte_ids
        for b in data:
            token_id = single[b]
            nxt = None if token_id < 0 else self.next_state(state, token_id)
            if nxt is None:
                return None
            state = nxt
        return state

    def is_complete(self, state: int) -> bool:
        """True when ``state`` accepts and nothing but EOS may follow (cached)."""
        hit = self._complete.get(state)
        if hit is None:
            hit = self.is_final(state) and not any(
                t not in self.eos_token_ids for t in self.index.get_allowed_tokens(state) or [])
            with self._lock:
                self._complete[state] = hit
        return hit

    def mask_for_state(self, state: int) -> torch.Tensor:
        """The packed allowed-token row of ``state`` (cached; do not write to it)."""
        mask = self._masks.get(state)
        if mask is not None:
            return mask
        allowed = self.index.get_allowed_tokens(state) or []
        eos = sorted(self.eos_token_ids)
        if self.is_final(state):
            mask = pack_token_ids(allowed, self.tokenizer_info.vocab_size, extra_ids=eos)
        else:
            mask = pack_token_ids(allowed, self.tokenizer_info.vocab_size, drop_ids=eos)
        with self._lock:
            self._masks.setdefault(state, mask)
        return mask

    def forced_bytes(self, state: int) -> tuple[bytes, list[int]]:
        """Bytes the grammar forces from ``state`` and the state after each of them (cached)."""
        hit = self._forced.get(state)
        if hit is not None:
            return hit
        out = bytearray()
        states: list[int] = []
        cur = state
        while len(out) < MAX_JUMP_BYTES:
            b = self._only_next_byte(cur)
            if b is None:
                break
            nxt = self.next_state(cur, self.tokenizer_info.single_byte_ids[b])
            if nxt is None:
                break
            out.append(b)
            states.append(nxt)
            cur = nxt
        result = (bytes(out), states)
        with self._lock:
            self._forced.setdefault(state, result)
        return result

    def _only_next_byte(self, state: int) -> int | None:
        # forced = not accepting (EOS would be an alternative) and every allowed token starts with one byte
        if self.is_final(state):
            return None
        token_bytes = self.tokenizer_info.token_bytes
        first: int | None = None
        for t in self.index.get_allowed_tokens(state) or []:
            data = token_bytes[t] if t < len(token_bytes) else None
            if not data:
                continue
            if first is None:
                first = data[0]
            elif data[0] != first:
                return None
        if first is None or self.tokenizer_info.single_byte_ids[first] < 0:
            return None
        return first


def utf8_prefix_len(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that is complete UTF-8."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            data[:cut].decode("utf-8")
            return cut
        except UnicodeDecodeError:
            continue
    return 0


class Grammar:
    """Per-request matching state over a shared CompiledGrammar.

    Invariants:
    - ``state`` is always a live state of the index: every output accepted so far
      is a prefix of some string of the language.
    - ``allowed_token_mask`` allows exactly the tokens ``accept_token`` accepts:
      tokens whose bytes keep the output a live prefix, plus the EOS ids only in
      accepting states. After termination only the EOS ids are set.
    - ``accept_token`` and ``jump_forward_accept`` change nothing when they
      return False; ``copy`` gives an independent state (the index is shared).
    - No side effects on the CompiledGrammar other than filling its caches.
    """

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self.state: int = compiled.initial_state
        self._terminated = False

    def allowed_token_mask(self, into: torch.Tensor) -> None:
        """Fill ``into`` ([ceil(vocab_size / 32)] int32, any device) with the allowed tokens."""
        num_words = self.compiled.tokenizer_info.num_words()
        if into.dtype != torch.int32 or into.shape != (num_words,):
            raise ValueError(f"into must be an int32 tensor of shape ({num_words},), "
                             f"got {into.dtype} {tuple(into.shape)}")
        if self._terminated:
            into.copy_(pack_token_ids(sorted(self.compiled.eos_token_ids), self.compiled.tokenizer_info.vocab_size))
            return
        into.copy_(self.compiled.mask_for_state(self.state), non_blocking=True)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when it isn't allowed."""
        if self._terminated:
            return False
        if token_id in self.compiled.eos_token_ids:
            if not self.compiled.is_final(self.state):
                return False
            self._terminated = True
            return True
        nxt = self.compiled.next_state(self.state, token_id)
        if nxt is None:
            return False
        self.state = nxt
        return True

    def is_terminated(self) -> bool:
        """True once an EOS id was accepted in an accepting state."""
        return self._terminated

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS would be allowed)."""
        return self.compiled.is_final(self.state)

    def is_complete(self) -> bool:
        """True when the output is a complete match that nothing but EOS can extend."""
        return not self._terminated and self.compiled.is_complete(self.state)

    def try_jump_forward(self) -> str | None:
        """The text the grammar forces next (cut to whole UTF-8 characters), or None."""
        if self._terminated:
            return None
        data, _ = self.compiled.forced_bytes(self.state)
        cut = utf8_prefix_len(data)
        return data[:cut].decode("utf-8") if cut else None

    def jump_forward_accept(self, token_ids: Sequence[int]) -> bool:
        """Advance by the scheduler's tokenization of forced (or any valid) text.

        Tries the ids as tokens; failing that (a token the index doesn't know),
        walks their concatenated bytes. False, state unchanged, when the ids
        don't spell a valid continuation: the scheduler then drops them and
        keeps decoding token by token under the mask.
        """
        if self._terminated:
            return False
        state: int | None = self.state
        for t in token_ids:
            state = self.compiled.next_state(state, t)
            if state is None:
                break
        if state is None:
            token_bytes = self.compiled.tokenizer_info.token_bytes
            parts = [token_bytes[t] if 0 <= t < len(token_bytes) else None for t in token_ids]
            if any(p is None for p in parts):
                return False
            state = self.compiled.advance_bytes(self.state, b"".join(parts))  # type: ignore[arg-type]
            if state is None:
                return False
        self.state = state
        return True

    def accept_text(self, text: str | bytes) -> bool:
        """Advance by raw text; False (state unchanged) when it leaves the grammar."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        if self._terminated:
            return not data
        state = self.compiled.advance_bytes(self.state, data)
        if state is None:
            return False
        self.state = state
        return True

    def copy(self) -> Grammar:
        other = Grammar(self.compiled)
        other.state = self.state
        other._terminated = self._terminated
        return other
