"""DeepSeek-V3 / R1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``."""
from __future__ import annotations

from radixlang.runtime.entrypoints.openai.tool_parsers.base import (
    PartialCall, Snapshot, ToolParser, marker_holdback, skip_value, skip_ws,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```json"


def _read_call(text: str, i: int) -> tuple[PartialCall | None, int | None]:
    """One call from text[i] (just past CALL_BEGIN): (call so far or None if malformed, end or None)."""
    sep = text.find(SEP, i)
    if sep == -1:
        return PartialCall(name=None), None
    nl = text.find("\n", sep + len(SEP))
    if nl == -1:
        return PartialCall(name=None), None
    call = PartialCall(name=text[sep + len(SEP):nl].strip())
    j = skip_ws(text, nl + 1)
    if text.startswith(FENCE, j):
        j = skip_ws(text, j + len(FENCE))
    elif len(text) - j < len(FENCE) and FENCE.startswith(text[j:]):
        return call, None
    end = skip_value(text, j)
    call.arguments = text[j:] if end is None else text[j:end]
    if end is None:
        return call, None
    close = text.find(CALL_END, end)
    call.done = close != -1
    return call, None if close == -1 else close + len(CALL_END)


class DeepSeekV3Parser(ToolParser):
    name = "deepseekv3"
    markers = (CALLS_BEGIN,)
    syntax = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    example = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}NAME\n```json\n{{...}}\n```{CALL_END}{CALLS_END}"
    call_end, call_prefix, call_separator, call_suffix = "\n```" + CALL_END, CALLS_BEGIN, "\n", CALLS_END
    call_trigger = CALLS_BEGIN

    def call_begin(self, name: str) -> str:
        return f"{CALL_BEGIN}function{SEP}{name}\n{FENCE}\n"

    def snapshot(self, text: str, *, final: bool) -> Snapshot:
        at = text.find(CALLS_BEGIN)
        if at == -1:
            keep = len(text) if final else len(text) - marker_holdback(text, (CALLS_BEGIN,))
            return Snapshot(content=text[:keep])
        snap = Snapshot(content=text[:at])
        i = at + len(CALLS_BEGIN)
        while True:
            nxt = text.find(CALL_BEGIN, i)
            if nxt == -1:
                break
            call, end = _read_call(text, nxt + len(CALL_BEGIN))
            if call is None:
                break
            snap.calls.append(call)
            if end is None:
                break
            i = end
        done = text.find(CALLS_END, i)
        if done != -1:  # text after the calls block is content again
            snap.content += text[done + len(CALLS_END):]
        return snap
