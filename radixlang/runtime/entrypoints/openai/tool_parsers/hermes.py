"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call."""
from __future__ import annotations

import json

from radixlang.runtime.entrypoints.openai.tool_parsers.base import (
    Snapshot, ToolParser, json_call, marker_holdback, skip_ws,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tagged_snapshot(parser_text: str, open_: str, close: str, *, final: bool, read_body) -> Snapshot:
    """Content outside ``open_ ... close`` blocks; each block's body read by ``read_body(body, closed)``."""
    snap = Snapshot()
    pos = 0
    while True:
        start = parser_text.find(open_, pos)
        if start == -1:
            tail = parser_text[pos:]
            keep = len(tail) if final else len(tail) - marker_holdback(tail, (open_,))
            snap.content += tail[:keep]
            return snap
        snap.content += parser_text[pos:start]
        body_start = start + len(open_)
        end = parser_text.find(close, body_start)
        body = parser_text[body_start:] if end == -1 else parser_text[body_start:end]
        calls = read_body(body, end != -1 or final)
        if calls is None:  # not a call after all: at the end, the block is plain text
            if final or end != -1:
                snap.content += parser_text[start:] if end == -1 else parser_text[start:end + len(close)]
            if end == -1:
                return snap
        else:
            snap.calls.extend(calls)
        if end == -1:
            return snap
        pos = end + len(close)


def read_json_body(body: str, closed: bool):
    i = skip_ws(body, 0)
    if i >= len(body):
        return None if closed else []
    got = json_call(body, i)
    if got is None:
        return None
    if closed and (got.end is None or got.call.name is None):
        return None
    return [got.call]


class HermesParser(ToolParser):
    name = "hermes"
    markers = (OPEN,)
    syntax = (OPEN, CLOSE)
    call_end, call_separator = "}\n" + CLOSE, "\n"
    call_trigger = OPEN

    def call_begin(self, name: str) -> str:
        return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": '

    def snapshot(self, text: str, *, final: bool) -> Snapshot:
        return tagged_snapshot(text, OPEN, CLOSE, final=final, read_body=read_json_body)
