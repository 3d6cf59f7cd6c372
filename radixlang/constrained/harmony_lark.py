"""A harmony call block (structural_tag.py's ``harmony: true``) as an llguidance Lark grammar.

gpt-oss replies in harmony messages, the first one's ``<|start|>assistant`` already in the prompt::

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>
    ... <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

so the free text is a run of messages, and a call is a commentary message whose header names a
recipient. The grammar::

    start:   turn* last
    turn:    message END SEP  |  call SEP         (calls here only with several calls allowed)
    last:    message RETURN?  |  call
    message: CHANNEL ("analysis" | "commentary" | "final") MESSAGE BODY
    call:    CHANNEL "commentary " BEGIN_i %json{schema_i} END_i

where SEP is the tag's ``separator`` (``<|start|>assistant``) and BEGIN_i / END_i a structure's begin
(``to=functions.NAME <|constrain|>json<|message|>``) and end (``<|call|>``). A marker that is a special
token of the tokenizer is that token (``<[id]>``); one that is an EOS id is left out and ends the reply
there (gpt-oss lists ``<|call|>`` and ``<|return|>`` as EOS: the grammar accepts after the call's JSON,
and the scheduler ends the request on the EOS, or at once where nothing else may follow); any other is
text. No body spells out a marker, which the parser would read as one: every header that names a
recipient is a call the grammar holds to its tool's schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from radixlang.constrained.structural_tag import StructuralTagSpec, regex_literal
from radixlang.constrained.structural_tag_lark import lark_str

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
CHANNELS = ("analysis", "commentary", "final")
CALL_CHANNEL = "commentary "  # a call's header: the channel, then the recipient (the trigger) and the rest


class _Forms:
    """Text with its markers written as this tokenizer has them."""

    def __init__(self, special_ids: Mapping[str, int], eos_names: Mapping[str, int]) -> None:
        self.special_ids, self.eos_names = special_ids, eos_names
        names = sorted({*MARKERS, *special_ids, *eos_names}, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(n) for n in names) + ")")

    def piece(self, text: str) -> tuple[str, bool]:
        """Lark items for ``text``, and whether an EOS token ends it (then it is the reply's end)."""
        items: list[str] = []
        parts = [p for p in self._split.split(text) if p]
        for i, part in enumerate(parts):
            if part in self.special_ids:
                items.append(f"<[{self.special_ids[part]}]>")
            elif part in self.eos_names:
                if i != len(parts) - 1:
                    raise ValueError(f"invalid structural_tag grammar: {part} is an EOS token of this tokenizer, "
                                     f"so nothing can follow it in {text!r}")
                return " ".join(items), True
            else:
                items.append(lark_str(part))
        return " ".join(items), False

    def inner(self, text: str) -> str:
        """Lark items for text that the reply goes on after."""
        items, ends = self.piece(text)
        if ends:
            raise ValueError(f"invalid structural_tag grammar: {text!r} holds an EOS token of this tokenizer, "
                             f"and a harmony reply goes on after it")
        return items


def harmony_tag_lark(tag: StructuralTagSpec, schemas: Sequence[Any], options: dict[str, Any], *,
                     special_ids: Mapping[str, int], eos_names: Mapping[str, int]) -> str:
    """The grammar of the module docstring for a harmony call block; ``special_ids`` / ``eos_names``: the
    tokenizer's special tokens by name (TokenizerInfo)."""
    if tag.prefix or tag.suffix or not tag.separator:
        raise ValueError("invalid structural_tag grammar: a harmony block has a separator (the next message's "
                         "start) and no prefix or suffix")
    forms = _Forms(special_ids, eos_names)
    channel, message = forms.inner(CHANNEL), forms.inner(MESSAGE)
    sep, sep_ends = forms.piece(tag.separator)
    end, end_ends = forms.piece(END)
    ret, _ = forms.piece(RETURN)
    calls: list[str] = []
    call_ends = False
    for i, (s, schema) in enumerate(zip(tag.structures, schemas)):
        if schema is False:
            continue
        close, ends = forms.piece(s.end)
        call_ends = call_ends or ends
        body = {**schema, "x-guidance": options} if isinstance(schema, dict) else schema
        calls.append(f"call_{i}: {channel} {lark_str(CALL_CHANNEL)} {forms.inner(s.begin)} "
                     f"%json {json.dumps(body)} {close}")
    if not calls:
        raise ValueError("invalid structural_tag grammar: every structure has the schema false")
    turns = [] if end_ends or sep_ends else [f"message {end} {sep}"]
    if not (tag.stop_after_first or call_ends or sep_ends):  # a call, then the next message
        turns.append(f"call {sep}")
    forbidden = "|".join(_regex(m) for m in MARKERS)
    lines = ["%llguidance {}",
             "start: turn* last" if turns else "start: last",
             *([f"turn: {' | '.join(turns)}"] if turns else []),
             f"last: message ({ret})? | call" if ret else "last: message | call",
             f"message: {channel} ({' | '.join(lark_str(c) for c in CHANNELS)}) {message} BODY",
             f"BODY: /(.|\\n)*/ & ~/(.|\\n)*({forbidden})(.|\\n)*/",
             "call: " + " | ".join(c.split(":", 1)[0] for c in calls),
             *calls]
    return "\n".join(lines) + "\n"


def _regex(text: str) -> str:
    """text as a literal inside a Lark /regex/."""
    return regex_literal(text).replace("/", "\\/")
