"""JSON -> regex: schemas through outlines-core, "any JSON object" written here.

The regexes use the Rust regex syntax of outlines-core (a byte-level DFA is built
from them), which for what is used here equals Python's ``re`` syntax, so tests
can check outputs with ``re.fullmatch``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from outlines_core.json_schema import build_regex_from_schema

DEFAULT_WHITESPACE = r"[ ]?"
# SGLang spells "any JSON" as this json_schema value
ANY_JSON_MARKER = "$$ANY$$"

# A JSON string: no raw control characters, escapes as RFC 8259 allows them.
JSON_STRING = r'"([^"\\\x00-\x1F]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
JSON_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
JSON_SCALAR = rf"({JSON_STRING}|{JSON_NUMBER}|true|false|null)"


def _array_of(value: str, ws: str) -> str:
    return rf"\[{ws}({value}({ws},{ws}{value})*)?{ws}\]"


def _object_of(value: str, ws: str) -> str:
    member = rf"{JSON_STRING}{ws}:{ws}{value}"
    return rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"


def any_json_value_regex(*, depth: int = 2, whitespace_pattern: str = DEFAULT_WHITESPACE) -> str:
    """Any JSON value whose arrays/objects nest at most ``depth`` levels."""
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    value = JSON_SCALAR
    for _ in range(depth):
        value = rf"({JSON_SCALAR}|{_array_of(value, whitespace_pattern)}|{_object_of(value, whitespace_pattern)})"
    return value


def any_json_object_regex(*, depth: int = 2, whitespace_pattern: str = DEFAULT_WHITESPACE) -> str:
    """Any JSON object (the top level counts as one of the ``depth`` levels)."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1 for an object, got {depth}")
    inner = any_json_value_regex(depth=depth - 1, whitespace_pattern=whitespace_pattern)
    return _object_of(inner, whitespace_pattern)


def ascii_digits(regex: str) -> str:
    """Replace ``\\d`` (Unicode digits in the Rust regex engine) with ASCII 0-9, as JSON Schema means it."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            out.append(("0-9" if in_class else "[0-9]") if nxt == "d" else c + nxt)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


MAX_ENUM_RANGE = 1000
_VALUE_KEYS = frozenset({"enum", "const", "default", "examples"})


def _int_bound(node: dict, inclusive: str, exclusive: str, step: int) -> int | None:
    value = node.get(inclusive)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return math.ceil(value) if step > 0 else math.floor(value)
    value = node.get(exclusive)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return math.floor(value) + 1 if step > 0 else math.ceil(value) - 1
    return None


def bound_integer_ranges(node: Any) -> Any:
    """Rewrite bounded integer schemas as enums (outlines-core ignores minimum/maximum).

    Only small ranges (at most MAX_ENUM_RANGE values) are rewritten; wider bounds
    stay unenforced.
    """
    if isinstance(node, list):
        return [bound_integer_ranges(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _VALUE_KEYS else bound_integer_ranges(v)) for k, v in node.items()}
    if out.get("type") == "integer":
        lo = _int_bound(out, "minimum", "exclusiveMinimum", 1)
        hi = _int_bound(out, "maximum", "exclusiveMaximum", -1)
        if lo is not None and hi is not None and 0 <= hi - lo < MAX_ENUM_RANGE:
            rest = {k: v for k, v in out.items()
                    if k not in ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")}
            return {**rest, "enum": list(range(lo, hi + 1))}
    return out


def json_schema_to_regex(schema: str | dict | None, *, whitespace_pattern: str | None = None,
                         any_depth: int = 2) -> str:
    """A regex for the documents ``schema`` accepts; None (or "$$ANY$$") = any JSON object.

    Raises ValueError naming the problem for text that is not JSON or a schema
    outlines-core can't turn into a regex.
    """
    ws = DEFAULT_WHITESPACE if whitespace_pattern is None else whitespace_pattern
    if schema is None or schema == ANY_JSON_MARKER:
        return any_json_object_regex(depth=any_depth, whitespace_pattern=ws)
    if isinstance(schema, dict):
        schema = json.dumps(schema)
    if not isinstance(schema, str):
        raise ValueError(f"json schema must be a JSON string, a dict or None, got {type(schema).__name__}")
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"json schema must be valid JSON, got {schema[:80]!r}: {e}") from None
    if not isinstance(parsed, (dict, bool)):
        raise ValueError(f"json schema must be a JSON object, got {type(parsed).__name__}: {schema[:80]!r}")
    if isinstance(parsed, dict):
        schema = json.dumps(bound_integer_ranges(parsed))
    try:
        return ascii_digits(build_regex_from_schema(schema, ws))
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"unsupported or invalid json schema: {first_line} (schema: {schema[:80]!r})") from None
