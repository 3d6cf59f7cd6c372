"""gpt-oss (OpenAI harmony): messages ``<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]<|message|>BODY``
ended by ``<|call|>``, ``<|end|>`` or ``<|return|>``, with ``<|start|>assistant`` before each later message.
A message to ``functions.NAME`` is a call (BODY its JSON arguments); the final channel (and commentary with no
recipient: a preamble) is content; the analysis channel is reasoning, which this parser leaves out."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from radixlang.runtime.entrypoints.openai.tool_parsers.base import (
    PartialCall, Snapshot, ToolParser, marker_holdback,
)

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|call|>", "<|end|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([\w.\-]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")


@dataclass
class HarmonyMessage:
    channel: str | None  # None: text outside any message header
    recipient: str | None
    body: str
    closed: bool
    span: tuple[int, int] = (0, 0)  # the message's text, header and end marker included (as far as certain)


def harmony_messages(text: str, *, final: bool) -> list[HarmonyMessage]:
    """Split text into messages; an open header or a body ending in a possible end marker is held back."""
    out: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        head = _next_header(text, pos)
        if head == -1:
            tail = text[pos:]
            keep = len(tail) if final else len(tail) - marker_holdback(tail, (START, CHANNEL))
            if tail[:keep]:
                out.append(HarmonyMessage(None, None, tail[:keep], closed=True, span=(pos, pos + keep)))
            return out
        if head > pos:
            out.append(HarmonyMessage(None, None, text[pos:head], closed=True, span=(pos, head)))
        msg = text.find(MESSAGE, head)
        if msg == -1:
            return out  # the header is still being written
        header = text[head:msg]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        body_start = msg + len(MESSAGE)
        ends = [(text.find(e, body_start), e) for e in ENDS]
        ends = [(i, e) for i, e in ends if i != -1]
        if ends:
            end, marker = min(ends)
            pos = end + len(marker)
            out.append(HarmonyMessage(channel.group(1) if channel else None,
                                      recipient.group(1) if recipient else None, text[body_start:end], True,
                                      span=(head, pos)))
            continue
        body = text[body_start:]
        keep = len(body) if final else len(body) - marker_holdback(body, ENDS)
        # the last message needs no end marker (an EOS id ends it: <|call|>, <|return|>), but one that has
        # no body yet was cut off (a call's arguments never begun), not ended
        out.append(HarmonyMessage(channel.group(1) if channel else None,
                                  recipient.group(1) if recipient else None, body[:keep], final and keep > 0,
                                  span=(head, body_start + keep)))
        return out
    return out


def _next_header(text: str, pos: int) -> int:
    found = [i for i in (text.find(START, pos), text.find(CHANNEL, pos)) if i != -1]
    return min(found) if found else -1


class GptOssParser(ToolParser):
    name = "gpt-oss"
    markers = ("<|channel|>", "<|constrain|>")
    syntax = (START, CHANNEL, MESSAGE, "<|constrain|>", *ENDS)
    example = "<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>"
    call_end, call_separator = "<|call|>", START + "assistant"
    # in auto mode the recipient is the trigger: a header may name it before or after the channel
    call_trigger = "to=functions."

    def call_begin(self, name: str) -> str:
        return f"{CHANNEL}commentary to=functions.{name} <|constrain|>json{MESSAGE}"

    def auto_call_begin(self, name: str) -> str:
        return f"to=functions.{name} <|constrain|>json{MESSAGE}"

    def harmony_tag(self, tools: list[tuple[str, Any]], *, parallel: bool) -> dict[str, Any]:
        """``auto_tag`` for a tokenizer whose harmony markers are special tokens: the free text is harmony
        messages framed by those tokens, a call a commentary message to a listed tool (llguidance only:
        constrained/harmony_lark.py)."""
        tag = self.auto_tag(tools, parallel=parallel)
        if tag is None:
            raise RuntimeError("the gpt-oss parser gave no auto-mode tag")
        return {**tag, "harmony": True}

    def snapshot(self, text: str, *, final: bool) -> Snapshot:
        snap = Snapshot()
        for m in harmony_messages(text, final=final):
            if m.recipient is not None:
                snap.calls.append(PartialCall(name=m.recipient, arguments=m.body, done=m.closed))
            elif m.channel != "analysis":
                snap.content += m.body
        return snap
