"""Incremental detokenization.

Text is emitted only once it is stable: a token sequence whose decoding ends
in a broken UTF-8 character (U+FFFD) waits for the next token, and text that
could be the start of a stop string, or of a stop_regex match (a partial match
running to the end of the text), is held back until it is known not to be
one. At finish, the text is cut before the matched stop string or regex match
unless ``no_stop_trim``, so a stream's text adds up to the whole reply's.
"""
from __future__ import annotations

import dataclasses

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import regex

from radixlang.runtime.io_struct import BatchStrOut, BatchTokenIDOut, FinishReason, OutputRow, TextRow, TokenRow

_REPLACEMENT = "\ufffd"


@dataclass
class DecodeState:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # start of the window decoded for context
    read_offset: int = 0  # tokens already turned into `text`
    text: str = ""  # stable text decoded so far
    sent_len: int = 0  # characters of text already emitted


class IncrementalDecoder:
    """Turns a growing list of token ids into text without broken characters."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.kwargs = {"skip_special_tokens": skip_special_tokens,
                       "spaces_between_special_tokens": spaces_between_special_tokens}
        self.state = DecodeState()

    def _decode(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids, **self.kwargs)
        except TypeError:  # tokenizers that do not take spaces_between_special_tokens
            return self.tokenizer.decode(ids, skip_special_tokens=self.kwargs["skip_special_tokens"])

    def append(self, new_ids: list[int], *, final: bool = False) -> str:
        """Add tokens; return the full stable text so far."""
        st = self.state
        st.ids.extend(new_ids)
        prefix_text = self._decode(st.ids[st.prefix_offset:st.read_offset])
        full_text = self._decode(st.ids[st.prefix_offset:])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith(_REPLACEMENT)):
            st.text += full_text[len(prefix_text):]
            st.prefix_offset = st.read_offset
            st.read_offset = len(st.ids)
        elif final and len(st.ids) > st.read_offset:
            st.read_offset = len(st.ids)
        return st.text


def stop_holdback(text: str, stop_strs: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string (it may yet become one;
    the tool-call and reasoning parsers hold back their markers by the same rule)."""
    best = 0
    for s in stop_strs:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def stop_regex_holdback(text: str, patterns: list[str], start: int = 0) -> int:
    """Length of the tail of text, from the earliest place at or after ``start`` where a match of one
    of ``patterns`` begins or may yet begin (a partial match that runs to the end of the text)."""
    cut = len(text)
    for pattern in patterns:
        try:
            m = regex.search(pattern, text, pos=start, partial=True)
        except regex.error:  # valid for re (checked at admission) but not for regex: no hold-back
            continue
        if m is not None and m.start() < cut:
            cut = m.start()
    return len(text) - cut


def trim_at_stop_regex(text: str, pattern: str, start: int = 0) -> str:
    """Cut text before the first match of a stop_regex ending past `start` (the part already sent stays)."""
    for m in re.finditer(pattern, text):
        if m.end() > start:
            return text[:max(m.start(), start)]
    return text


def trim_at_stop(text: str, stop_strs: list[str], start: int = 0) -> str:
    """Cut text before the earliest stop string found at or after `start`."""
    cut = len(text)
    for s in stop_strs:
        pos = text.find(s, start)
        if pos != -1:
            cut = min(cut, pos)
    return text[:cut]


class DetokenizerManager:
    """Keeps one IncrementalDecoder per running request and emits text deltas."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decoders: dict[str, IncrementalDecoder] = {}

    def handle(self, out: BatchTokenIDOut) -> BatchStrOut:
        return BatchStrOut(rows=[self._row(row) for row in out.rows])

    def _row(self, row: TokenRow) -> TextRow:
        dec = self.decoders.get(row.rid)
        if dec is None:
            dec = IncrementalDecoder(self.tokenizer, skip_special_tokens=row.skip_special_tokens,
                                     spaces_between_special_tokens=row.spaces_between_special_tokens)
            self.decoders[row.rid] = dec
        finished = row.finished_reason
        text = dec.append(row.output_ids, final=finished is not None)
        stops, patterns = row.stop_strs, row.stop_regexes
        if finished is None:
            visible = len(text) - stop_holdback(text, stops) if stops else len(text)
            if patterns:
                visible = min(visible, len(text) - stop_regex_holdback(text, patterns, dec.state.sent_len))
        else:
            reason = FinishReason.from_dict(finished)
            if not row.no_stop_trim and reason.kind == "stop" and isinstance(reason.matched, str):
                if reason.matched in stops:
                    text = trim_at_stop(text, stops, start=dec.state.sent_len)
                else:  # a stop_regex pattern (the scheduler reports which one matched)
                    text = trim_at_stop_regex(text, reason.matched, start=dec.state.sent_len)
            visible = len(text)
            del self.decoders[row.rid]
        visible = max(visible, dec.state.sent_len)
        delta = text[dec.state.sent_len:visible]
        dec.state.sent_len = visible
        return TextRow(text_delta=delta, **{f.name: getattr(row, f.name) for f in dataclasses.fields(OutputRow)})

    def abort(self, rid: str) -> None:
        self.decoders.pop(rid, None)
