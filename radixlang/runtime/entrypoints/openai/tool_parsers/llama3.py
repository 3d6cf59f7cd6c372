"""Llama 3.1 / 3.2 JSON tool calls: ``<|python_tag|>{"name": ..., "parameters": {...}}`` (several joined by
``;``), or a bare ``{"name": ..., "parameters": ...}`` as the whole reply."""
from __future__ import annotations

import json

from radixlang.runtime.entrypoints.openai.tool_parsers.base import (
    Snapshot, ToolParser, json_call, marker_holdback, skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


def json_sequence(text: str, i: int, *, final: bool, separators: str = ";,") -> tuple[list, bool]:
    """Calls of a run of JSON objects from text[i] (between them: whitespace and separators).

    Returns (calls, ok): ok is False when something other than a call object was found."""
    calls = []
    while True:
        i = skip_ws(text, i)
        while i < len(text) and text[i] in separators:
            i = skip_ws(text, i + 1)
        if i >= len(text):
            return calls, True
        got = json_call(text, i)
        if got is None or (final and got.end is None) or (got.end is not None and got.call.name is None):
            return calls, False
        calls.append(got.call)
        if got.end is None:
            return calls, True
        i = got.end


class Llama3JsonParser(ToolParser):
    name = "llama3"
    markers = (PYTHON_TAG,)
    syntax = (PYTHON_TAG,)
    example = '{"name": NAME, "parameters": {...}}'
    call_end, call_prefix, call_separator = "}", PYTHON_TAG, "; "
    call_trigger, bare_start = PYTHON_TAG, True

    def call_begin(self, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": '

    def snapshot(self, text: str, *, final: bool) -> Snapshot:
        lead = skip_ws(text, 0)
        tag = text.find(PYTHON_TAG)
        if tag == -1 and text[lead:lead + 1] == "{":
            start = lead  # a bare JSON reply: a call, or (when it turns out not to be one) plain content
        elif tag != -1:
            start = tag + len(PYTHON_TAG)
        else:
            keep = len(text) if final else len(text) - marker_holdback(text, (PYTHON_TAG,))
            return Snapshot(content=text[:keep])
        calls, ok = json_sequence(text, start, final=final)
        content = text[:tag] if tag != -1 else ""
        if not ok:
            if not calls and final:
                return Snapshot(content=text)
            return Snapshot(content=content, calls=calls)
        return Snapshot(content=content, calls=calls)


class BareJsonParser(Llama3JsonParser):
    """Calls as bare ``{"name": ..., "arguments": {...}}`` objects: the forced form for a format whose
    arguments are not JSON (pythonic)."""
    name = "json"
    example = '{"name": NAME, "arguments": {...}}'
    call_prefix, call_separator = "", "\n"
    call_trigger, bare_start = None, False  # only ever forced

    def call_begin(self, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "arguments": '
