"""Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``."""
from __future__ import annotations

import json

from radixlang.runtime.entrypoints.openai.tool_parsers.base import Snapshot, ToolParser, marker_holdback, skip_ws
from radixlang.runtime.entrypoints.openai.tool_parsers.llama3 import json_sequence

MARKER = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (MARKER,)
    syntax = (MARKER,)
    example = '[TOOL_CALLS] [{"name": NAME, "arguments": {...}}]'
    call_end, call_prefix, call_separator, call_suffix = "}", MARKER + " [", ", ", "]"
    call_trigger = MARKER

    def call_begin(self, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "arguments": '

    def snapshot(self, text: str, *, final: bool) -> Snapshot:
        at = text.find(MARKER)
        if at == -1:
            keep = len(text) if final else len(text) - marker_holdback(text, (MARKER,))
            return Snapshot(content=text[:keep])
        i = skip_ws(text, at + len(MARKER))
        if text[i:i + 1] == "[":
            i += 1
        calls, ok = json_sequence(text, i, final=False, separators=",]")
        if final and not calls:
            return Snapshot(content=text)
        return Snapshot(content=text[:at], calls=calls)
