"""Whether a tool call's arguments text is (or can still become) one JSON object.

A streamed call's arguments arrive piece by piece; a call whose arguments cannot be a JSON object
(``"{...}"``, ``{...}``) is the model's text, not a call, and the sooner that is known the less of
it was streamed as one.
"""
from __future__ import annotations

import json
import re

_NUMBER_PREFIX = re.compile(r"-?(0|[1-9][0-9]*)?(\.[0-9]*)?([eE][+-]?[0-9]*)?")
_LITERALS = ("true", "false", "null")
_WS = " \t\r\n"


def is_json_object(text: str) -> bool:
    """``text`` is exactly one JSON object (whitespace around it allowed)."""
    return _parses_as(text, dict)


def _parses_as(text: str, kind: type | tuple[type, ...]) -> bool:
    """``text`` is one JSON value of ``kind``."""
    try:
        return isinstance(json.loads(text), kind)
    except ValueError:
        return False


def object_prefix_ok(text: str) -> bool:
    """``text`` is a prefix of some JSON object (whitespace before it allowed): nothing rules it out yet."""
    stack: list[str] = []  # open containers: "{" or "["
    expect = "start"  # start | key | key_or_end | colon | value | value_or_end | comma_or_end | done
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in _WS:
            i += 1
            continue
        if expect == "done":
            return False
        if expect == "start":
            if c != "{":
                return False
            stack.append("{")
            expect, i = "key_or_end", i + 1
        elif expect in ("key", "key_or_end"):
            if c == "}" and expect == "key_or_end":
                stack.pop()
                expect, i = _after_value(stack), i + 1
            elif c == '"':
                end = _string_end(text, i)
                if end is None:
                    return _string_prefix_ok(text, i)
                if not _parses_as(text[i:end], str):
                    return False
                expect, i = "colon", end
            else:
                return False
        elif expect == "colon":
            if c != ":":
                return False
            expect, i = "value", i + 1
        elif expect in ("value", "value_or_end"):
            if c == "]" and expect == "value_or_end":
                stack.pop()
                expect, i = _after_value(stack), i + 1
            elif c in "{[":
                stack.append(c)
                expect, i = ("key_or_end" if c == "{" else "value_or_end"), i + 1
            elif c == '"':
                end = _string_end(text, i)
                if end is None:
                    return _string_prefix_ok(text, i)
                if not _parses_as(text[i:end], str):
                    return False
                expect, i = _after_value(stack), end
            else:
                j = i
                while j < n and text[j] not in _WS + ",]}":
                    j += 1
                word = text[i:j]
                if j == n:  # it may still grow
                    return any(lit.startswith(word) for lit in _LITERALS) or _NUMBER_PREFIX.fullmatch(word) is not None
                if word not in _LITERALS and not _parses_as(word, (int, float)):
                    return False
                expect, i = _after_value(stack), j
        elif expect == "comma_or_end":
            if c == ",":
                expect = "key" if stack[-1] == "{" else "value"
            elif c == ("}" if stack[-1] == "{" else "]"):
                stack.pop()
                expect = _after_value(stack)
            else:
                return False
            i += 1
    return True


def _after_value(stack: list[str]) -> str:
    return "comma_or_end" if stack else "done"


def _string_end(text: str, i: int) -> int | None:
    """Index just past the string starting at text[i] == '"', or None if the text ends inside it."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _string_prefix_ok(text: str, i: int) -> bool:
    """An unterminated string from text[i]: no raw control character, no bad escape so far."""
    try:
        json.loads(text[i:] + '"')
        return True
    except ValueError:
        try:  # it may end inside an escape: "\\" or "\\u12"
            json.loads(text[i:] + '0000"' if "\\u" in text[i:][-6:] else text[i:] + 'n"')
            return True
        except ValueError:
            return False
