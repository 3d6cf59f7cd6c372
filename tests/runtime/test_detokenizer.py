from __future__ import annotations

import pytest

from radixlang.runtime.managers.detokenizer import IncrementalDecoder, stop_holdback, trim_at_stop


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
