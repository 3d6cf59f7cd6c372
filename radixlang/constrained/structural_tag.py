"""Structural tags: free text until a trigger, then ``begin`` + a JSON body + ``end``, then free text.

The spec is SGLang's / xgrammar's::

    {"type": "structural_tag",
     "structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}],
     "triggers": ["<function="]}

Every ``begin`` must start with one of the triggers. ``normalize_structural_tag``
checks the shape and returns a canonical JSON string (the compile-cache key).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixlang.constrained.errors import UnsupportedGrammar

PARAM = "structural_tag"


@dataclass(frozen=True)
class Structure:
    begin: str
    schema: Any  # a JSON schema (dict or bool)
    end: str


@dataclass(frozen=True)
class StructuralTagSpec:
    structures: tuple[Structure, ...]
    triggers: tuple[str, ...]

    def trigger_of(self, structure: Structure) -> str:
        """The longest trigger ``structure.begin`` starts with."""
        return max((t for t in self.triggers if structure.begin.startswith(t)), key=len)


def _fail(message: str) -> UnsupportedGrammar:
    return UnsupportedGrammar(f"structural_tag: {message}", PARAM)


def parse_structural_tag(spec: str | dict) -> StructuralTagSpec:
    """Parse and check a structural tag (JSON text or dict); UnsupportedGrammar naming the problem."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise _fail(f"must be valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise _fail(f"must be a JSON object, got {type(spec).__name__}")
    unknown = set(spec) - {"type", "structures", "triggers"}
    if unknown:
        raise _fail(f"unknown field(s) {sorted(unknown)}: expected type, structures, triggers")
    if spec.get("type", "structural_tag") != "structural_tag":
        raise _fail(f"type must be 'structural_tag', got {spec.get('type')!r}")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise _fail("structures must be a non-empty list of {begin, schema, end}")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise _fail("triggers must be a non-empty list of non-empty strings")
    out: list[Structure] = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"} or not {"begin", "end"} <= set(s):
            raise _fail(f"structures[{i}] must be an object with begin, schema, end")
        begin, end, schema = s["begin"], s["end"], s.get("schema", True)
        if not isinstance(begin, str) or not isinstance(end, str):
            raise _fail(f"structures[{i}].begin and .end must be strings")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise _fail(f"structures[{i}].schema must be a JSON schema: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise _fail(f"structures[{i}].schema must be a JSON schema object, got {type(schema).__name__}")
        if not any(begin.startswith(t) for t in triggers):
            raise _fail(f"structures[{i}].begin {begin!r} starts with none of the triggers {triggers}")
        out.append(Structure(begin, schema, end))
    return StructuralTagSpec(tuple(out), tuple(triggers))


def normalize_structural_tag(spec: str | dict) -> str:
    """Canonical JSON text of a checked structural tag (sorted keys: equal tags share a cache entry)."""
    parsed = parse_structural_tag(spec)
    return json.dumps({"type": "structural_tag", "triggers": list(parsed.triggers),
                       "structures": [{"begin": s.begin, "schema": s.schema, "end": s.end}
                                      for s in parsed.structures]}, sort_keys=True, ensure_ascii=False)
