"""Reasoning parsers: split a reply's reasoning (``reasoning_content``) from the rest.

Like the tool-call parsers, each reads the whole text so far into a snapshot
(reasoning, rest) that only grows by prefixes, so streamed deltas and a whole
parse agree. ``rest`` is what the tool-call parser (or the client, as content) gets.
"""
from __future__ import annotations

from dataclasses import dataclass

from radixlang.runtime.entrypoints.openai.tool_parsers.base import marker_holdback
from radixlang.runtime.entrypoints.openai.tool_parsers.gpt_oss import GptOssParser, harmony_messages

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str
    rest: str


class ReasoningParser:
    name = ""
    syntax: tuple[str, ...] = (THINK_OPEN, THINK_CLOSE)  # the markers it reads
    # where the reasoning ends: a grammar constraint starts after it (None: no marker a grammar can wait for)
    reasoning_end: str | None = THINK_CLOSE

    @staticmethod
    def thinks(template_kwargs: dict | None) -> bool:
        """Whether the reply reasons (starts inside it), given the request's chat_template_kwargs."""
        return True

    def __init__(self) -> None:
        self.text = ""
        self._sent = Split("", "")

    def snapshot(self, text: str, *, final: bool) -> Split:
        raise NotImplementedError

    def parse(self, text: str) -> Split:
        return self.snapshot(text, final=True)

    def parse_delta(self, piece: str, *, final: bool = False) -> Split:
        """Add ``piece``; return the reasoning and rest text it makes certain."""
        self.text += piece
        snap = self.snapshot(self.text, final=final)
        delta = Split(snap.reasoning[len(self._sent.reasoning):], snap.rest[len(self._sent.rest):])
        self._sent = Split(snap.reasoning if len(snap.reasoning) > len(self._sent.reasoning) else self._sent.reasoning,
                           snap.rest if len(snap.rest) > len(self._sent.rest) else self._sent.rest)
        return delta


def _think_split(body: str, *, final: bool) -> Split:
    """body is inside <think> from its start: reasoning until </think>, the rest after it."""
    close = body.find(THINK_CLOSE)
    if close == -1:
        keep = len(body) if final else len(body) - marker_holdback(body, (THINK_CLOSE,))
        return Split(body[:keep], "")
    return Split(body[:close], body[close + len(THINK_CLOSE):].lstrip("\n"))


def _leading_think(text: str, *, final: bool) -> Split | None:
    """The split of a reply that opens with <think> (after whitespace), nothing yet while the reply
    may still be spelling <think>, or None when it does not open with one."""
    body = text.lstrip()
    if body.startswith(THINK_OPEN):
        return _think_split(body[len(THINK_OPEN):], final=final)
    if not final and THINK_OPEN.startswith(body):
        return Split("", "")
    return None


class DeepSeekR1Parser(ReasoningParser):
    """DeepSeek-R1: the template opens <think> in the prompt, so the reply starts in reasoning
    (a leading <think> is dropped too); with no </think> the whole reply is reasoning."""
    name = "deepseek-r1"

    def snapshot(self, text: str, *, final: bool) -> Split:
        lead = _leading_think(text, final=final)
        return _think_split(text, final=final) if lead is None else lead


class Qwen3Parser(ReasoningParser):
    """Qwen3: reasoning only when the reply starts with <think> (enable_thinking=False: it does not)."""
    name = "qwen3"

    @staticmethod
    def thinks(template_kwargs: dict | None) -> bool:
        return (template_kwargs or {}).get("enable_thinking", True) is not False

    def snapshot(self, text: str, *, final: bool) -> Split:
        lead = _leading_think(text, final=final)
        return Split("", text) if lead is None else lead


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss: the analysis channel is the reasoning; every other message is kept, markers and all."""
    name = "gpt-oss"
    syntax = GptOssParser.syntax
    reasoning_end = None  # the final channel's header follows the analysis message, not one marker

    def snapshot(self, text: str, *, final: bool) -> Split:
        reasoning, rest = "", ""
        for m in harmony_messages(text, final=final):
            if m.channel == "analysis":
                reasoning += m.body
            else:
                rest += text[m.span[0]:m.span[1]]
        return Split(reasoning, rest)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek-r1": DeepSeekR1Parser, "qwen3": Qwen3Parser, "gpt-oss": GptOssReasoningParser,
}


def make_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name]()
