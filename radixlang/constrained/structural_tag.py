"""Structural tags: free text until a trigger, then ``begin`` + a JSON body + ``end``, then free text.

The spec is SGLang's / xgrammar's::

    {"type": "structural_tag",
     "structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}],
     "triggers": ["<function="]}

Every ``begin`` must start with one of the triggers. ``normalize_structural_tag``
checks the shape and returns a canonical JSON string (the compile-cache key).

A *forced* tag (radixlang's extension, what a forced tool call compiles to) has no
free text at all: the reply is ``prefix``, one or more structures joined by
``separator`` (exactly one with ``stop_after_first``), then ``suffix``; its
triggers may be omitted::

    {"type": "structural_tag", "forced": true, "separator": "\n", "stop_after_first": false,
     "structures": [{"begin": "<tool_call>\n{\"name\": \"f\", \"arguments\": ", "schema": {...},
                     "end": "}\n</tool_call>"}]}

A forced tag with ``answer_schema`` (tools and a response_format in one request) lets the reply be
either those calls or one JSON value of that schema.

A triggered tag with a *call block* (``prefix`` / ``separator`` / ``suffix`` / ``stop_after_first``
without ``forced``: what an auto-mode tool call compiles to) has one trigger; from it on the text is
the block, ``prefix`` + structures joined by ``separator`` + ``suffix``, then free text again (with
``stop_after_first``: one call in one block, which ends the reply). ``bare_start: true`` also makes
a reply that opens (after whitespace) with ``{`` a block without its prefix (llama3's bare JSON calls),
so free text never opens with ``{``; only llguidance can write that.

``harmony: true`` on a call block (gpt-oss, whose harmony markers are special tokens) makes the free
text harmony messages (``<|channel|>analysis|commentary|final<|message|>BODY<|end|>``, the next one
after ``separator``), and a call a commentary message whose header goes on with a structure's
``begin`` (from the trigger ``to=functions.`` on); a marker that is a special token of the tokenizer is
that token, one that is an EOS id ends the reply there (constrained/harmony_lark.py; llguidance only).
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
    forced: bool = False  # no free text: prefix, structures joined by separator, suffix
    prefix: str = ""
    separator: str = ""
    suffix: str = ""
    stop_after_first: bool = False
    answer_schema: Any = None  # forced only: the reply may instead be one JSON value of this schema
    block: bool = False  # triggered only: a call block (prefix, structures joined by separator, suffix)
    bare_start: bool = False  # block only: a reply opening with "{" is a block without its prefix
    harmony: bool = False  # block only: the free text is harmony messages (see the module docstring)

    def trigger_of(self, structure: Structure) -> str:
        """The longest trigger ``structure.begin`` starts with."""
        return max((t for t in self.triggers if structure.begin.startswith(t)), key=len)


def _fail(message: str) -> UnsupportedGrammar:
    return UnsupportedGrammar(f"structural_tag: {message}", PARAM)


_FORCED_FIELDS = ("forced", "prefix", "separator", "suffix", "stop_after_first")
_BLOCK_FIELDS = ("prefix", "separator", "suffix", "stop_after_first")


def parse_structural_tag(spec: str | dict) -> StructuralTagSpec:
    """Parse and check a structural tag (JSON text or dict); UnsupportedGrammar naming the problem."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise _fail(f"must be valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise _fail(f"must be a JSON object, got {type(spec).__name__}")
    unknown = set(spec) - {"type", "structures", "triggers", "answer_schema", "bare_start", "harmony",
                           *_FORCED_FIELDS}
    if unknown:
        raise _fail(f"unknown field(s) {sorted(unknown)}: expected type, structures, triggers "
                    f"(and for a forced tag {', '.join(_FORCED_FIELDS)}, answer_schema; for a call block "
                    f"{', '.join(_BLOCK_FIELDS)}, bare_start, harmony)")
    if spec.get("type", "structural_tag") != "structural_tag":
        raise _fail(f"type must be 'structural_tag', got {spec.get('type')!r}")
    forced = spec.get("forced", False)
    if not isinstance(forced, bool):
        raise _fail(f"forced must be a bool, got {forced!r}")
    block = not forced and bool(set(spec) & set(_BLOCK_FIELDS))
    extra = _forced_fields(spec) if forced or block else {}
    if not forced and "answer_schema" in spec:
        raise _fail("answer_schema needs forced: true")
    if "bare_start" in spec and (forced or not block or not isinstance(spec["bare_start"], bool)):
        raise _fail("bare_start must be a bool, on a call block (prefix / separator / suffix without forced)")
    if "harmony" in spec and (forced or not block or not isinstance(spec["harmony"], bool)):
        raise _fail("harmony must be a bool, on a call block (prefix / separator / suffix without forced)")
    structures, triggers = spec.get("structures"), spec.get("triggers", [] if forced else None)
    if not isinstance(structures, list) or not structures:
        raise _fail("structures must be a non-empty list of {begin, schema, end}")
    if not isinstance(triggers, list) or (not triggers and not forced) or not all(
            isinstance(t, str) and t for t in triggers):
        raise _fail("triggers must be a non-empty list of non-empty strings")
    if block and len(triggers) != 1:
        raise _fail(f"a call block needs exactly one trigger, got {triggers}")
    out: list[Structure] = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"} or not {"begin", "end"} <= set(s):
            raise _fail(f"structures[{i}] must be an object with begin, schema, end")
        begin, end = s["begin"], s["end"]
        if not isinstance(begin, str) or not isinstance(end, str):
            raise _fail(f"structures[{i}].begin and .end must be strings")
        schema = _schema(s.get("schema", True), f"structures[{i}].schema")
        opening = extra.get("prefix", "") + begin if block else begin
        if not forced and not any(opening.startswith(t) for t in triggers):
            where = "prefix + begin" if block else "begin"
            raise _fail(f"structures[{i}].{where} {opening!r} starts with none of the triggers {triggers}")
        out.append(Structure(begin, schema, end))
    answer = _schema(spec["answer_schema"], "answer_schema") if "answer_schema" in spec else None
    return StructuralTagSpec(tuple(out), tuple(triggers), forced=forced, answer_schema=answer, block=block,
                             bare_start=bool(spec.get("bare_start", False)), harmony=bool(spec.get("harmony", False)),
                             **extra)


def _schema(schema: Any, where: str) -> Any:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise _fail(f"{where} must be a JSON schema: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise _fail(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    return schema


def _forced_fields(spec: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("prefix", "separator", "suffix"):
        value = spec.get(name, "")
        if not isinstance(value, str):
            raise _fail(f"{name} must be a string, got {value!r}")
        out[name] = value
    stop = spec.get("stop_after_first", False)
    if not isinstance(stop, bool):
        raise _fail(f"stop_after_first must be a bool, got {stop!r}")
    out["stop_after_first"] = stop
    return out


def normalize_structural_tag(spec: str | dict) -> str:
    """Canonical JSON text of a checked structural tag (sorted keys: equal tags share a cache entry)."""
    parsed = parse_structural_tag(spec)
    out: dict[str, Any] = {"type": "structural_tag", "triggers": list(parsed.triggers),
                           "structures": [{"begin": s.begin, "schema": s.schema, "end": s.end}
                                          for s in parsed.structures]}
    if parsed.forced or parsed.block:
        out.update(prefix=parsed.prefix, separator=parsed.separator, suffix=parsed.suffix,
                   stop_after_first=parsed.stop_after_first)
    if parsed.forced:
        out["forced"] = True
        if parsed.answer_schema is not None:
            out["answer_schema"] = parsed.answer_schema
    if parsed.bare_start:
        out["bare_start"] = True
    if parsed.harmony:
        out["harmony"] = True
    return json.dumps(out, sort_keys=True, ensure_ascii=False)


def regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (in both Python's and outlines-core's syntax)."""
    return "".join(f"\\{c}" if c in _REGEX_META else _REGEX_CONTROL.get(c, c) for c in text)


_REGEX_META = set("\\.^$|?*+()[]{}-")
_REGEX_CONTROL = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def forced_tag_regex(tag: StructuralTagSpec, body_regexes: list[str], answer_regex: str | None = None) -> str:
    """The regex of a forced tag, given each structure's body regex (the outlines backend's form), and
    ``answer_regex``: the answer_schema's regex when the tag has one."""
    one = "(" + "|".join(regex_literal(s.begin) + f"({body})" + regex_literal(s.end)
                         for s, body in zip(tag.structures, body_regexes)) + ")"
    calls = one if tag.stop_after_first else f"{one}({regex_literal(tag.separator)}{one})*"
    forced = regex_literal(tag.prefix) + calls + regex_literal(tag.suffix)
    return forced if answer_regex is None else f"({forced})|({answer_regex})"
