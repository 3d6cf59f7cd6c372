from __future__ import annotations

import pytest

from radixlang.runtime.front.detokenizer import (
    DetokenizerManager, IncrementalDecoder, stop_holdback, stop_regex_holdback, trim_at_stop,
)
from radixlang.runtime.io_struct import BatchTokenIDOut, FinishReason, TokenRow


class ByteTokenizer:
    """Each token is one UTF-8 byte: multi-byte characters span tokens."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_never_emits_broken_utf8():
    text = "héllo 世界 🎉"
    dec = IncrementalDecoder(ByteTokenizer())
    seen = []
    for b in text.encode():
        seen.append(dec.append([b]))
    assert seen[-1] == text
    assert all("\ufffd" not in s for s in seen)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))


@pytest.mark.parametrize("text,stops,hold", [("abc", ["cd"], 1), ("abc", ["xyz"], 0), ("ab", ["abc"], 2),
                                             ("a##", ["###"], 2)])
def test_stop_holdback(text, stops, hold):
    assert stop_holdback(text, stops) == hold


def test_trim_at_stop():
    assert trim_at_stop("hello END there", ["END"]) == "hello "
    assert trim_at_stop("a.b.c", [".", "b"]) == "a"


@pytest.mark.parametrize("text,patterns,start,hold", [
    ("total: 1", [r"\d{3}"], 0, 1),  # "1" may grow into three digits
    ("total: 12", [r"\d{3}"], 0, 2),
    ("no digits", [r"\d{3}"], 0, 0),
    ("say fo", [r"foo\d", r"zz"], 0, 2),
    ("xaqq", [r"a.*z"], 0, 3),  # a match begun may still end anywhere later
    ("xaqq", [r"a.*z"], 2, 0),  # only matches from start on count
])
def test_stop_regex_holdback(text, patterns, start, hold):
    assert stop_regex_holdback(text, patterns, start) == hold


def _stream(patterns: list[str], ids: list[int], matched: str | None) -> tuple[list[str], str]:
    """Feed ids one by one through a DetokenizerManager; the last message finishes (by the pattern)."""
    mgr = DetokenizerManager(ByteTokenizer())
    deltas = []
    for k, tok in enumerate(ids):
        last = k == len(ids) - 1
        reason = (FinishReason.stop(matched) if matched else FinishReason.max_tokens(len(ids))) if last else None
        row = TokenRow(rid="r", output_ids=[tok], finished_reason=reason.to_dict() if reason else None,
                       prompt_tokens=1, completion_tokens=k + 1, cached_tokens=0, stop_regexes=patterns)
        deltas.append(mgr.handle(BatchTokenIDOut(rows=[row])).rows[0].text_delta)
    return deltas, "".join(deltas)


def test_streamed_stop_regex_never_shows_what_the_trim_removes():
    text = "order 12 then 345 end"
    deltas, whole = _stream([r"\d{3}"], list(text[:text.index("345") + 3].encode()), r"\d{3}")
    assert whole == "order 12 then "  # the same text the whole (non-streamed) reply gets
    assert "".join(deltas[:8]) == "order "  # "1" and "12" were held back until the space ended them
    _, plain = _stream([r"\d{3}"], list(b"no match 12"), None)
    assert plain == "no match 12"  # a hold-back is released at the end
