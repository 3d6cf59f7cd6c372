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


_VALUE_KEYS = frozenset({"enum", "const", "default", "examples"})
_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# bounded integers become this const (a number no schema spells) and its regex literal is replaced afterwards
_SENTINEL_BASE = 7_390_218_546_100_000


def _int_bound(node: dict, inclusive: str, exclusive: str, step: int) -> int | None:
    """The tightest integer bound of ``node`` on one side (step 1: lower, -1: upper), or None."""
    bounds = []
    value = node.get(inclusive)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bounds.append(math.ceil(value) if step > 0 else math.floor(value))
    value = node.get(exclusive)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bounds.append(math.floor(value) + 1 if step > 0 else math.ceil(value) - 1)
    if not bounds:
        return None
    return max(bounds) if step > 0 else min(bounds)


def _same_length_range(lo: str, hi: str) -> str:
    """Regex for the decimal strings of one length from lo to hi (lo <= hi), exact."""
    if lo == hi:
        return lo
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    n = len(lo) - 1
    if lo[0] == hi[0]:
        return lo[0] + "(" + _same_length_range(lo[1:], hi[1:]) + ")"
    if lo[1:] == "0" * n and hi[1:] == "9" * n:
        return f"[{lo[0]}-{hi[0]}][0-9]{{{n}}}"
    parts = [lo[0] + "(" + _same_length_range(lo[1:], "9" * n) + ")"]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}][0-9]{{{n}}}")
    parts.append(hi[0] + "(" + _same_length_range("0" * n, hi[1:]) + ")")
    return "|".join(parts)


def _natural_range(lo: int, hi: int | None) -> str:
    """Regex for the decimals (no leading zeros) of the integers in [lo, hi], 0 <= lo; hi None = unbounded."""
    parts = []
    top = hi if hi is not None else 10 ** len(str(lo)) - 1
    for digits in range(len(str(lo)), len(str(top)) + 1):
        a = max(lo, 10 ** (digits - 1) if digits > 1 else 0)
        b = min(top, 10 ** digits - 1)
        if a <= b:
            parts.append(_same_length_range(str(a), str(b)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{len(str(lo))},}}")
    return "|".join(f"({p})" for p in parts)


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """An exact regex for the JSON integers in [lo, hi] (None: unbounded on that side); ValueError if empty."""
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"integer range is empty: minimum {lo} > maximum {hi}")
    parts = []
    if hi is None or hi >= 0:  # the non-negative part
        parts.append(_natural_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:  # the negative part: -x for x in [max(1, -hi), -lo]
        neg_lo = max(1, -hi) if hi is not None else 1
        parts.append("-(" + _natural_range(neg_lo, -lo if lo is not None else None) + ")")
    return "(" + "|".join(f"({p})" for p in parts) + ")"


def bound_integers(node: Any, found: list[str] | None = None) -> tuple[Any, list[str]]:
    """Replace each bounded integer schema by a sentinel const; returns (schema, regex per sentinel).

    outlines-core ignores minimum/maximum; ``json_schema_to_regex`` swaps each
    sentinel's literal in the built regex for ``integer_range_regex`` of its bounds.
    """
    found = [] if found is None else found
    if isinstance(node, list):
        return [bound_integers(x, found)[0] for x in node], found
    if not isinstance(node, dict):
        return node, found
    out = {k: (v if k in _VALUE_KEYS else bound_integers(v, found)[0]) for k, v in node.items()}
    if out.get("type") == "integer" and any(k in out for k in _BOUND_KEYS) and "enum" not in out \
            and "const" not in out:
        lo = _int_bound(out, "minimum", "exclusiveMinimum", 1)
        hi = _int_bound(out, "maximum", "exclusiveMaximum", -1)
        found.append(integer_range_regex(lo, hi))
        rest = {k: v for k, v in out.items() if k not in ("type", *_BOUND_KEYS)}
        return {**rest, "const": _SENTINEL_BASE + len(found) - 1}, found
    return out, found


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
    ranges: list[str] = []
    if isinstance(parsed, dict):
        bounded, ranges = bound_integers(parsed)
        schema = json.dumps(bounded)
    try:
        regex = ascii_digits(build_regex_from_schema(schema, ws))
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"unsupported or invalid json schema: {first_line} (schema: {schema[:80]!r})") from None
    for i, sub in enumerate(ranges):
        literal = str(_SENTINEL_BASE + i)
        if literal not in regex:  # a repeated subschema (array items, allOf) holds it more than once
            raise ValueError(f"unsupported json schema: a bounded integer could not be placed ({literal})")
        regex = regex.replace(literal, sub)
    return regex
