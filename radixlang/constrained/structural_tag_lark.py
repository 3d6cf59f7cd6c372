"""Forced tags and call-block tags (constrained/structural_tag.py) as llguidance Lark grammars.

A forced tag is ``prefix call (separator call)* suffix`` (one call with ``stop_after_first``), or that
or one JSON value of its ``answer_schema``. A call block is free text that never holds the trigger,
except where a block begins: the lazy ``trig`` lexeme ends at the first trigger, after which the block
is forced (the trigger's part of its opening is already written). The text after the last block
cannot hold the trigger either (a negated lexeme), so every trigger the model writes opens a block
that the grammar holds to the tools' schemas. With ``stop_after_first`` the one call ends the reply.
``bare_start`` adds a reply opening with ``{`` as a block without its prefix, and keeps free text
from opening with ``{``.

A trigger that is a special token of the tokenizer (Llama 3.1's ``<|python_tag|>``, given in
``special_ids``) is that token, by id (``<[id]>``): the model writes it as one token, which ends the
text before it (no lazy lexeme needed); no text may spell it out, since the parser would read that
as a call too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from radixlang.constrained.structural_tag import StructuralTagSpec, regex_literal

_ANY = r"/(.|\n)*/"
_BRACE_START = r"~/[ \t\r\n]*\{(.|\n)*/"


def lark_str(text: str) -> str:
    """A Lark string literal for text (nothing for the empty string)."""
    return json.dumps(text) if text else ""


def _json(schema: Any, options: dict[str, Any]) -> str:
    body = {**schema, "x-guidance": options} if isinstance(schema, dict) else schema
    return f"%json {json.dumps(body)}"


def _calls(tag: StructuralTagSpec, schemas: Sequence[Any], options: dict[str, Any], *, name: str,
           cut: int = 0) -> list[str]:
    """Rules ``name``: one of the structures (the first ``cut`` characters of each begin left out)."""
    rules = [f"{name}_{i}: {lark_str(s.begin[cut:])} {_json(schema, options)} {lark_str(s.end)}"
             for i, (s, schema) in enumerate(zip(tag.structures, schemas)) if schema is not False]
    if not rules:
        raise ValueError("invalid structural_tag grammar: every structure has the schema false")
    return [f"{name}: " + " | ".join(r.split(":", 1)[0] for r in rules), *rules]


def _repeat(tag: StructuralTagSpec, first: str) -> str:
    """``first`` then, unless stop_after_first, more calls joined by the separator."""
    return first if tag.stop_after_first else f"{first} ({lark_str(tag.separator)} call)*"


def forced_tag_lark(tag: StructuralTagSpec, schemas: Sequence[Any], options: dict[str, Any]) -> str:
    """prefix, calls joined by separator, suffix (or, with answer_schema, one JSON value of it)."""
    lines = [f"calls: {lark_str(tag.prefix)} {_repeat(tag, 'call')} {lark_str(tag.suffix)}",
             *_calls(tag, schemas, options, name="call")]
    if tag.answer_schema is None:
        return "\n".join(["start: calls", *lines]) + "\n"
    return "\n".join(["start: calls | answer", f"answer: {_json(tag.answer_schema, options)}", *lines]) + "\n"


def block_tag_lark(tag: StructuralTagSpec, schemas: Sequence[Any], options: dict[str, Any], *,
                   special_ids: Mapping[str, int] | None = None) -> str:
    """Free text with call blocks at the trigger (see the module docstring); ``special_ids``: the
    tokenizer's special tokens by name."""
    trigger = tag.triggers[0]
    if tag.prefix and not tag.prefix.startswith(trigger):
        raise ValueError(f"invalid structural_tag grammar: the prefix {tag.prefix!r} must start with the "
                         f"trigger {trigger!r}")
    no_trigger = f"{_ANY} & ~/(.|\\n)*{_regex(trigger)}(.|\\n)*/"
    token_id = (special_ids or {}).get(trigger)
    if token_id is None:  # a text trigger: the lazy lexeme of the text before a block ends at the first one
        opener, lazy, text = lark_str(trigger), "[lazy]", _ANY
    else:  # the token ends the text before it; that text may not spell it either (the parser would read a call)
        opener, lazy, text = f"<[{token_id}]>", "", no_trigger
    lines = ["%llguidance {}"]
    # stop_after_first: one block of one call ends the reply (as on xgrammar)
    after = "" if tag.stop_after_first else "block* TAIL"
    if tag.bare_start:  # a reply opening with "{" is a block without prefix; free text never opens so
        lines += [f"start: bare | FIRST_TAIL | first_block {after}",
                  f"bare: /[ \\t\\r\\n]*/ {_repeat(tag, 'call')} {lark_str(tag.suffix)} {after}",
                  "first_block: first_trig block_rest",
                  f"first_trig{lazy}: NB_TEXT {opener}",
                  f"NB_TEXT: {text} & {_BRACE_START}",
                  f"FIRST_TAIL: {no_trigger} & {_BRACE_START}"]
    else:
        lines.append(f"start: TAIL | block {after}")
    lines += ["block: trig block_rest",
              f"trig{lazy}: TAG_TEXT {opener}",
              f"TAG_TEXT: {text}",
              f"TAIL: {no_trigger}"]
    if tag.prefix:  # the trigger lies within the prefix: the rest of the prefix, then whole calls
        lines.append(f"block_rest: {lark_str(tag.prefix[len(trigger):])} {_repeat(tag, 'call')} "
                     f"{lark_str(tag.suffix)}")
    else:  # the trigger opens each call: the first call's begin goes on after it
        lines.append(f"block_rest: {_repeat(tag, 'first_call')} {lark_str(tag.suffix)}")
        lines += _calls(tag, schemas, options, name="first_call", cut=len(trigger))
    lines += _calls(tag, schemas, options, name="call")
    return "\n".join(lines) + "\n"


def _regex(text: str) -> str:
    """text as a literal inside a Lark /regex/."""
    return regex_literal(text).replace("/", "\\/")
