"""The tool-call parser interface and the pieces the formats share.

A parser sees the model's whole output text so far (``parse_delta`` takes the new
piece and keeps the text) and re-reads it into a ``Snapshot``: the plain content
that is certain, and the calls begun so far, each with its name once complete and
the raw text of its arguments so far. Every format keeps a snapshot growing by
prefixes only (content and each call's arguments only ever get longer), so the
deltas are the differences between two snapshots, and a whole ``parse`` is the
final snapshot: streamed and whole output agree by construction.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixlang.runtime.entrypoints.openai.tool_parsers.json_prefix import is_json_object, object_prefix_ok
from radixlang.runtime.front.detokenizer import stop_holdback


@dataclass
class PartialCall:
    name: str | None  # None until the name is complete
    arguments: str = ""  # raw JSON text of the arguments so far (a prefix of the final text)
    done: bool = False


@dataclass
class Snapshot:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """What one ``parse_delta`` adds: content text and OpenAI tool-call delta entries."""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ParseResult:
    content: str | None  # None only when there are calls and no text around them
    calls: list[ToolCall]


class ToolParser:
    """One model family's tool-call format. Subclasses implement ``snapshot`` and list ``markers``."""
    name = ""
    markers: tuple[str, ...] = ()  # strings whose presence in a chat template names this format
    syntax: tuple[str, ...] = ()  # every marker the format writes (kept in the text when they are special tokens)
    # how to call a tool in this format, told to a model whose chat template cannot render tools
    example = '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>'
    # a forced call (tool_choice required / named) in this format: prefix, calls joined by the separator, suffix;
    # each call is call_begin(name), the arguments as JSON, call_end (None: the format has no JSON arguments)
    call_end: str | None = None
    call_prefix = call_separator = call_suffix = ""
    # tool_choice auto: the marker every call opens with in free text (None: none, so calls cannot be held to
    # their schemas), and whether a reply may also open with the calls' bare JSON (llama3)
    call_trigger: str | None = None
    bare_start = False

    def __init__(self, tool_names: set[str] | None = None) -> None:
        self.tool_names = tool_names  # None: accept any name
        self.text = ""
        self._sent_content = 0
        self._ids: list[str] = []  # one per reported call (known names only)
        self._sent_args: list[int] = []
        self._shown: list[int] = []  # per reported call, its position among the snapshot's calls

    # -- what a format implements -----------------------------------------------------------------
    def snapshot(self, text: str, *, final: bool) -> Snapshot:
        raise NotImplementedError

    def call_begin(self, name: str) -> str:
        """The text of a call to ``name`` up to its JSON arguments."""
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------------
    def forced_tag(self, tools: list[tuple[str, Any]], *, parallel: bool) -> dict[str, Any] | None:
        """The forced structural tag of one or more calls (one unless ``parallel``) of the (name, parameters
        schema) tools in this format, or None when the format has no JSON arguments."""
        if self.call_end is None:
            return None
        return {"type": "structural_tag", "forced": True, "prefix": self.call_prefix,
                "separator": self.call_separator, "suffix": self.call_suffix, "stop_after_first": not parallel,
                "structures": [{"begin": self.call_begin(name), "schema": schema, "end": self.call_end}
                               for name, schema in tools]}

    def auto_call_begin(self, name: str) -> str:
        """A call's opening in free text (from its trigger on, the trigger included); as forced by default."""
        return self.call_begin(name)

    def auto_tag(self, tools: list[tuple[str, Any]], *, parallel: bool) -> dict[str, Any] | None:
        """The structural tag of tool_choice auto: free text, and from the call trigger on a block of calls
        (one unless ``parallel``) held to their tools' schemas; None when the format has no trigger."""
        if self.call_trigger is None or self.call_end is None:
            return None
        tag = {"type": "structural_tag", "triggers": [self.call_trigger], "prefix": self.call_prefix,
               "separator": self.call_separator, "suffix": self.call_suffix, "stop_after_first": not parallel,
               "structures": [{"begin": self.auto_call_begin(name), "schema": schema, "end": self.call_end}
                              for name, schema in tools]}
        if self.bare_start:
            tag["bare_start"] = True
        return tag

    def parse(self, text: str) -> ParseResult:
        """The whole output at once; a call whose arguments are not a JSON object is no call."""
        snap = self._known(self.snapshot(text, final=True))
        valid = [c for c in snap.calls if _arguments_ok(c, final=True)]
        calls = [ToolCall(id=_call_id(), name=c.name or "", arguments=c.arguments) for c in valid]
        if len(valid) < len(snap.calls) and not calls:  # nothing but malformed calls: the reply is text
            return ParseResult(content=text, calls=[])
        # with calls, content is the text around them (None when there is none); without, the reply as it is
        content = (snap.content.strip() or None) if calls else snap.content
        return ParseResult(content=content, calls=calls)

    def parse_delta(self, piece: str, *, final: bool = False) -> Delta:
        """Add ``piece`` to the output; return the content and tool-call deltas it makes certain."""
        self.text += piece
        snap = self._known(self.snapshot(self.text, final=final))
        delta = Delta(content=snap.content[self._sent_content:])
        self._sent_content = max(self._sent_content, len(snap.content))
        # a call is shown once its arguments have begun as a JSON object, and never while they cannot be
        # one; one already shown keeps its index but sends nothing more (a stream cannot take it back)
        for pos, call in enumerate(snap.calls):
            ok = _arguments_ok(call, final=final)
            if pos in self._shown:
                index = self._shown.index(pos)
                if ok and len(call.arguments) > self._sent_args[index]:
                    delta.tool_calls.append({"index": index, "function": {
                        "arguments": call.arguments[self._sent_args[index]:]}})
                    self._sent_args[index] = len(call.arguments)
            elif ok and _begun(call) and pos > max(self._shown, default=-1):
                index = len(self._ids)
                self._shown.append(pos)
                self._ids.append(_call_id())
                self._sent_args.append(len(call.arguments))
                delta.tool_calls.append({"index": index, "id": self._ids[index], "type": "function",
                                         "function": {"name": call.name, "arguments": call.arguments}})
        return delta

    def _known(self, snap: Snapshot) -> Snapshot:
        """Calls with a complete name, and only names among the tools (others are dropped)."""
        calls = [c for c in snap.calls if c.name is not None
                 and (self.tool_names is None or c.name in self.tool_names)]
        return Snapshot(content=snap.content, calls=calls)


def _arguments_ok(call: PartialCall, *, final: bool) -> bool:
    """The call's arguments are a JSON object, or (while it goes on) can still become one."""
    if not call.arguments.strip():
        return not final or call.done  # none yet; a finished call without arguments keeps the old "" reading
    if call.done or final:
        return is_json_object(call.arguments)
    return object_prefix_ok(call.arguments)


def _begun(call: PartialCall) -> bool:
    """Enough of the arguments to tell an object from other text: "{" and the next character."""
    return call.done or len(call.arguments.strip()) >= 2


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# the text a parser holds back (a suffix that may yet become a marker) follows the detokenizer's stop-string rule
marker_holdback = stop_holdback


# ---- partial JSON -------------------------------------------------------------------------------
_WS = " \t\r\n"


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def skip_value(s: str, i: int) -> int | None:
    """End index of the JSON value starting at s[i], or None if the text ends first."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return _skip_string(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            ch = s[j]
            if ch == '"':
                end = _skip_string(s, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \t\r\n;":
        j += 1
    return j if j < len(s) else None  # a literal at the very end may still grow


def _skip_string(s: str, i: int) -> int | None:
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            return j + 1
        j += 1
    return None


@dataclass
class JsonCall:
    call: PartialCall
    end: int | None  # index just past the object, None while it is open


def json_call(s: str, i: int, *, name_keys: tuple[str, ...] = ("name",),
              args_keys: tuple[str, ...] = ("arguments", "parameters")) -> JsonCall | None:
    """Read ``{"name": ..., "arguments": {...}}`` starting at s[i] (s[i] == "{"), as far as it goes.

    Returns None when the text there cannot be such an object."""
    if i >= len(s) or s[i] != "{":
        return None
    call = PartialCall(name=None)
    j = skip_ws(s, i + 1)
    while True:
        if j >= len(s):
            return JsonCall(call, None)
        if s[j] == "}":
            call.done = call.name is not None
            return JsonCall(call, j + 1)
        if s[j] != '"':
            return None
        key_end = _skip_string(s, j)
        if key_end is None:
            return JsonCall(call, None)
        key = json.loads(s[j:key_end])
        j = skip_ws(s, key_end)
        if j >= len(s):
            return JsonCall(call, None)
        if s[j] != ":":
            return None
        j = skip_ws(s, j + 1)
        value_end = skip_value(s, j)
        if key in name_keys:
            if value_end is None:
                return JsonCall(call, None)
            try:
                name = json.loads(s[j:value_end])
            except ValueError:
                return None
            if not isinstance(name, str):
                return None
            call.name = name
        elif key in args_keys:
            call.arguments = s[j:] if value_end is None else s[j:value_end]
            if value_end is None:
                return JsonCall(call, None)
        elif value_end is None:
            return JsonCall(call, None)
        j = skip_ws(s, value_end)
        if j < len(s) and s[j] == ",":
            j = skip_ws(s, j + 1)
