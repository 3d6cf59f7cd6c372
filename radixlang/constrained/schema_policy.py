"""Which JSON-Schema keywords each backend enforces; every other keyword is refused.

A schema reaches a backend only when every keyword in it (at any depth) is
either an annotation (title, description, default ...: they constrain nothing)
or in that backend's table, and every ``format`` is in its format table. The
tables hold only what the schema-corpus tests (tests/constrained/
test_schema_fidelity.py) show the backend enforces: a random walk through the
grammar yields only documents that ``jsonschema`` accepts. Anything else is an
``UnsupportedGrammar`` naming the keyword and the backend, so the request fails
with a 400 instead of producing output that violates its schema.

Two keywords get special handling before the check:
- ``oneOf`` is enforced as ``anyOf`` (no backend can express "exactly one"),
  which is exact only when no document matches two branches: accepted when the
  branches are provably disjoint (distinct JSON types, or objects told apart by
  a required property with different ``const`` / ``enum`` values), refused otherwise.
- outlines-core ignores numeric bounds: bounded integers are rewritten into an
  exact regex by json_regex (so ``minimum``/``maximum``/``exclusive*`` on an
  integer are enforced); bounds on a ``number`` are refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from radixlang.constrained.errors import UnsupportedGrammar
from radixlang.constrained.json_regex import ascii_digits

ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "default", "examples",
                         "deprecated", "readOnly", "writeOnly", "$anchor"})

_CORE = frozenset({"type", "properties", "required", "additionalProperties", "items", "enum", "const",
                   "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minItems", "maxItems",
                   "minLength", "maxLength", "pattern", "format"})
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})

ENFORCED_KEYWORDS: dict[str, frozenset[str]] = {
    # numeric bounds only on integers (see module doc); checked in _check_node. outlines-core
    # writes allOf as the concatenation of its branches, xgrammar ignores it: both refuse it.
    # xgrammar's length-bounded strings allow raw control characters (invalid JSON), and in a
    # pattern it lets "([.][0-9]{1,6})?" match "8572" (a dot in an optional group matches any
    # character): minLength, maxLength and pattern are refused there
    "outlines": (_CORE - {"allOf"}) | _BOUNDS,
    "xgrammar": (_CORE - {"allOf", "minLength", "maxLength", "pattern"}) | _BOUNDS | {"prefixItems"},
    "llguidance": _CORE | _BOUNDS | {"prefixItems"},
}

# date, date-time and time are rewritten into EXACT_FORMAT_PATTERNS on every backend (the
# backends' own date regexes allow 2024-09-31); the rest are the backends' own
ENFORCED_FORMATS: dict[str, frozenset[str]] = {
    "outlines": frozenset({"uuid", "email"}),
    "xgrammar": frozenset({"uuid", "email"}),  # its ipv4 allows leading zeros (0.00.035.7)
    "llguidance": frozenset({"uuid", "email", "ipv4"}),
}

_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]([.][0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
EXACT_FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$"}

# The keyword check runs in the compile worker before the compile; its work is bounded (about a second
# per 100,000 units on a slow core) so that an oversized schema is refused by name, not by the timeout
MAX_CHECK_WORK = 1_000_000


class WorkBudget:
    """Units of work left to one schema's keyword check; ``spend`` refuses (naming the field) when out."""

    def __init__(self, limit: int = MAX_CHECK_WORK, param: str = "json_schema") -> None:
        self.left = limit
        self.limit = limit
        self.param = param

    def spend(self, units: int) -> None:
        self.left -= units
        if self.left < 0:
            raise UnsupportedGrammar(f"{self.param}: the schema is too large to check (more than {self.limit} "
                                     f"subschemas, branches and enum values in all)", self.param)


# keyword -> how its value holds subschemas
_SCHEMA_VALUED = ("additionalProperties", "items", "not", "contains", "if", "then", "else",
                  "propertyNames", "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _subschemas(node: dict) -> Iterator[tuple[str, Any]]:
    for key in _SCHEMA_VALUED:
        if key in node and isinstance(node[key], (dict, list)):
            value = node[key]
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(value)) if isinstance(value, list) \
                else ((key, value),)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(node[key]))
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from ((f"{key}.{name}", v) for name, v in node[key].items())


def _types(node: Any) -> set[str] | None:
    """The JSON types a (resolved-enough) schema allows, or None when it can't tell."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return {_json_type(node["const"])}
    if isinstance(node.get("enum"), list):
        return {_json_type(v) for v in node["enum"]}
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _required(branch: dict) -> set[str]:
    required = branch.get("required")
    return {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()


def _tags(branch: dict, prop: str) -> set[Any] | None:
    """The values a required property ``prop`` may take in an object branch (const / enum), else None."""
    sub = (branch.get("properties") or {}).get(prop)
    if not isinstance(sub, dict):
        return None
    if "const" in sub:
        return {repr(sub["const"])}
    if isinstance(sub.get("enum"), list):
        return {repr(v) for v in sub["enum"]}
    return None


def _numeric_as_one(types: set[str]) -> set[str]:
    """Types with integer and number merged: 1 is both, so two branches allowing either overlap."""
    return {"number" if t == "integer" else t for t in types}


def _no_value_twice(groups: list[set[Any]], budget: WorkBudget) -> bool:
    """True when no value is in two of ``groups`` (one pass over all values, not a pairwise walk)."""
    seen: set[Any] = set()
    for group in groups:
        budget.spend(len(group))
        if not seen.isdisjoint(group):
            return False
        seen |= group
    return True


def one_of_is_disjoint(branches: list[Any], resolve: Any = None, budget: WorkBudget | None = None) -> bool:
    """True when no JSON document can match two of ``branches`` (a sufficient check, not a complete one).

    Linear in the branches' size: each type and tag value is counted once, never compared
    pairwise (a oneOf of thousands of tagged objects took seconds per level pairwise).
    """
    budget = budget if budget is not None else WorkBudget()
    budget.spend(len(branches))
    resolved = [resolve(b) if resolve is not None else b for b in branches]
    kinds = [_types(b) for b in resolved]
    if all(k is not None for k in kinds) and \
            _no_value_twice([_numeric_as_one(k) for k in kinds if k is not None], budget):
        return True
    if not all(isinstance(b, dict) and _types(b) in ({"object"}, None) and "properties" in b for b in resolved):
        return False
    required = [_required(b) for b in resolved]
    budget.spend(sum(len(r) for r in required))
    common = set.intersection(*required) if required else set()  # props every branch requires
    for prop in sorted(common):
        tags = [_tags(b, prop) for b in resolved]
        if all(t is not None for t in tags) and _no_value_twice(tags, budget):  # type: ignore[arg-type]
            return True
    return False


def _resolver(root: Any) -> Any:
    def resolve(node: Any) -> Any:
        seen = 0
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/") \
                and seen < 32:
            target: Any = root
            for part in node["$ref"][2:].split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                target = target.get(part) if isinstance(target, dict) else None
            if target is None:
                return node
            node, seen = target, seen + 1
        return node
    return resolve


def check_schema(schema: Any, backend: str, param: str = "json_schema", budget: WorkBudget | None = None) -> None:
    """Refuse (UnsupportedGrammar naming keyword and backend) a schema the backend would not enforce,
    or one whose check would take more than ``budget`` (MAX_CHECK_WORK) units of work."""
    if backend not in ENFORCED_KEYWORDS:
        raise ValueError(f"unknown grammar backend {backend!r}: expected one of {sorted(ENFORCED_KEYWORDS)}")
    budget = budget if budget is not None else WorkBudget(param=param)
    try:
        _check_node(schema, "#", backend, param, _resolver(schema), budget)
    except RecursionError:
        raise UnsupportedGrammar(f"{param}: the schema nests too deeply to check", param) from None


def _refuse(message: str, backend: str, param: str) -> UnsupportedGrammar:
    return UnsupportedGrammar(f"{message} is not enforced by the {backend} grammar backend "
                              f"(choose another --grammar-backend or drop it)", param)


def _check_node(node: Any, where: str, backend: str, param: str, resolve: Any, budget: WorkBudget) -> None:
    budget.spend(1)
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise UnsupportedGrammar(f"json_schema: the schema at {where} must be an object or a boolean, "
                                 f"got {type(node).__name__}", param)
    allowed = ENFORCED_KEYWORDS[backend]
    for key, value in node.items():
        if key in ANNOTATIONS:
            continue
        if key not in allowed:
            if key == "uniqueItems" and value is False:
                continue
            raise _refuse(f"JSON-Schema keyword {key!r} (at {where})", backend, param)
        if key == "format" and value not in ENFORCED_FORMATS[backend]:
            raise _refuse(f"JSON-Schema format {value!r} (at {where})", backend, param)
        if key in _BOUNDS and backend == "outlines" and _types(node) != {"integer"}:
            raise _refuse(f"JSON-Schema keyword {key!r} on a non-integer (at {where})", backend, param)
        if key == "oneOf" and isinstance(value, list) and not one_of_is_disjoint(value, resolve, budget):
            raise _refuse(f"JSON-Schema keyword 'oneOf' with overlapping branches (at {where}; "
                          f"it is enforced as anyOf, exact only for disjoint branches)", backend, param)
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise _refuse(f"JSON-Schema $ref {value!r} outside the schema (at {where})", backend, param)
    for sub_where, sub in _subschemas(node):
        _check_node(sub, f"{where}/{sub_where}", backend, param, resolve, budget)


def exact_formats(node: Any) -> Any:
    r"""A copy of ``node`` with each date / time / date-time string format spelled as an exact pattern
    and ``\d`` in patterns spelled [0-9].

    Left as it is (and so checked against ENFORCED_FORMATS) where the node has its own pattern.
    """
    if isinstance(node, list):
        return [exact_formats(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("enum", "const", "default", "examples") else exact_formats(v)) for k, v in node.items()}
    if isinstance(out.get("pattern"), str):  # ECMA-262: \d is ASCII 0-9 (Rust regex: any Unicode digit)
        out["pattern"] = ascii_digits(out["pattern"])
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in EXACT_FORMAT_PATTERNS and "pattern" not in out:
        del out["format"]
        out["pattern"] = EXACT_FORMAT_PATTERNS[fmt]
    return out


def one_of_as_any_of(node: Any) -> Any:
    """A copy of ``node`` with every oneOf spelled anyOf (callers check disjointness first)."""
    if isinstance(node, list):
        return [one_of_as_any_of(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):
            out[key] = value
        elif key == "oneOf" and "anyOf" not in node:
            out["anyOf"] = one_of_as_any_of(value)
        else:
            out[key] = one_of_as_any_of(value)
    return out


def close_objects(node: Any, in_all_of: bool = False) -> Any:
    """A copy where objects with ``properties`` and no ``additionalProperties`` get it false.

    Every document of the result is valid under the original; it is what outlines-core and
    xgrammar's strict mode generate, and it keeps llguidance from writing unasked-for keys
    (allOf branches stay open: closing them could leave no document).
    """
    if isinstance(node, list):
        return [close_objects(x, in_all_of) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("enum", "const", "default", "examples") else close_objects(v, k == "allOf"))
           for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and not in_all_of \
            and out.get("type", "object") == "object" and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def prepare_schema(schema: Any, backend: str, param: str = "json_schema") -> Any:
    """Check ``schema`` against the backend's policy and return what the backend is given."""
    try:
        if "pattern" in ENFORCED_KEYWORDS.get(backend, ()):
            schema = exact_formats(schema)  # else the format itself is refused
        check_schema(schema, backend, param)
        return one_of_as_any_of(close_objects(schema))
    except RecursionError:
        raise UnsupportedGrammar(f"{param}: the schema nests too deeply to check", param) from None


def load_schema(spec: str, backend: str, param: str = "json_schema") -> Any:
    """A json_schema string parsed, checked against the backend's policy and prepared (oneOf as anyOf ...)."""
    try:
        parsed = json.loads(spec)
    except json.JSONDecodeError as e:
        raise UnsupportedGrammar(f"json schema must be valid JSON, got {spec[:80]!r}: {e}", param) from None
    except RecursionError:
        raise UnsupportedGrammar(f"{param}: the schema nests too deeply to read", param) from None
    if not isinstance(parsed, (dict, bool)):
        raise UnsupportedGrammar(f"json schema must be a JSON object, got {type(parsed).__name__}", param)
    return prepare_schema(parsed, backend, param)


# ---- --constrained-json-whitespace-pattern ---------------------------------------------------------
_JSON_WS = "[ \t\n\r]"


def check_whitespace_pattern(backend: str, pattern: str | None) -> dict[str, Any]:
    """How ``backend`` writes JSON whitespace matching ``pattern`` (between every two JSON tokens);
    ValueError naming the backend when it cannot.

    outlines and llguidance take any regex (outlines-core and llguidance lexemes: Rust regex syntax);
    xgrammar has three whitespace modes only: none at all, any JSON whitespace, or up to N of it, so
    the pattern must match exactly the same strings as "", ``[ \\t\\n\\r]*`` or ``[ \\t\\n\\r]{0,N}``.
    Returns xgrammar's compile_json_schema keywords (empty for the other backends, and for None).
    """
    if pattern is None:
        return {}
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"constrained_json_whitespace_pattern {pattern!r} is not a valid regex: {e}") from None
    if backend != "xgrammar":
        return {}
    import interegular

    try:
        fsm = interegular.parse_pattern(pattern).to_fsm()
    except Exception:  # noqa: BLE001 -- interegular reads a subset of regex syntax
        fsm = None
    if fsm is not None:
        if fsm.equivalent(interegular.parse_pattern("").to_fsm()):
            return {"any_whitespace": False, "separators": (",", ":")}
        if fsm.equivalent(interegular.parse_pattern(_JSON_WS + "*").to_fsm()):
            return {"any_whitespace": True}
        longest = _longest_match(fsm)
        if longest is not None and fsm.equivalent(interegular.parse_pattern(f"{_JSON_WS}{{0,{longest}}}").to_fsm()):
            return {"any_whitespace": True, "max_whitespace_cnt": longest}
    raise ValueError(f"the xgrammar grammar backend cannot use constrained_json_whitespace_pattern {pattern!r}: "
                     f"it writes JSON with no whitespace (pattern ''), any JSON whitespace ({_JSON_WS}*) or up to N "
                     f"of it ({_JSON_WS}{{0,N}}); outlines and llguidance take any regex")


def _longest_match(fsm: Any, limit: int = 256) -> int | None:
    """The length of the longest string the FSM accepts, None if unbounded or past ``limit``."""
    states, longest = {fsm.initial}, 0
    for length in range(1, limit + 2):
        states = {nxt for s in states for nxt in fsm.map.get(s, {}).values()}
        states = {s for s in states if _can_accept(fsm, s)}
        if not states:
            return longest
        if any(s in fsm.finals for s in states):
            longest = length
    return None


def _can_accept(fsm: Any, state: Any) -> bool:
    seen, todo = {state}, [state]
    while todo:
        s = todo.pop()
        if s in fsm.finals:
            return True
        for nxt in fsm.map.get(s, {}).values():
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False
