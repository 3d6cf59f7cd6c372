"""Pythonic calls (Llama 3.2 / 4, Kimi style): the reply is a Python list of calls,
``[get_weather(city="Paris"), add(a=1, b=2)]``; arguments are Python literals."""
from __future__ import annotations

import ast
import json
import re

from radixlang.runtime.entrypoints.openai.tool_parsers.base import PartialCall, Snapshot, ToolParser, skip_ws

_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_WRAP_OPEN, _WRAP_CLOSE = "<|python_start|>", "<|python_end|>"


def _could_start(text: str) -> bool:
    """Whether text (from the reply's start) may still grow into ``[name(``."""
    if _START.match(text):
        return True
    return re.fullmatch(r"\[\s*([A-Za-z_][\w.]*\s*)?", text) is not None


def parse_call_list(source: str) -> list[PartialCall] | None:
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        calls.append(PartialCall(name=ast.unparse(node.func), arguments=json.dumps(args), done=True))
    return calls


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = (_WRAP_OPEN,)
    syntax = (_WRAP_OPEN, _WRAP_CLOSE)
    example = "[NAME(ARG=VALUE, ...), ...]"

    def snapshot(self, text: str, *, final: bool) -> Snapshot:
        body = text.replace(_WRAP_OPEN, "").replace(_WRAP_CLOSE, "")
        lead = skip_ws(body, 0)
        if lead >= len(body):
            return Snapshot(content=body if final else "")
        rest = body[lead:]
        if not _could_start(rest):
            return Snapshot(content=body)
        end = _list_end(rest)
        if end is None:  # the list is still open: the calls come when it closes
            return Snapshot(content=body if final else "")
        calls = parse_call_list(rest[:end])
        if calls is None:
            return Snapshot(content=body)
        return Snapshot(content=rest[end:], calls=calls)


def _list_end(s: str) -> int | None:
    depth, i, quote = 0, 0, ""
    while i < len(s):
        c = s[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None
