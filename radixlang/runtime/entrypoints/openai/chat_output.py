"""One chat choice's output turned into an OpenAI message: reasoning split off, then tool calls parsed.

``ChatOutput`` runs the reasoning parser (``--reasoning-parser``) and the tool-call
parser (``--tool-call-parser``, when tools are active) over a choice's text, whole
(``message``) or as it streams (``delta``), so a stream sends text as soon as no
marker could be starting and tool-call arguments piece by piece.
"""
from __future__ import annotations

from typing import Any

from radixlang.runtime.entrypoints.openai.reasoning_parser import ReasoningParser, make_reasoning_parser
from radixlang.runtime.entrypoints.openai.tool_parsers import ToolParser, make_tool_parser
from radixlang.runtime.entrypoints.openai.tool_parsers.gpt_oss import GptOssParser
from radixlang.runtime.entrypoints.openai.tool_parsers.llama3 import BareJsonParser


class ChatOutput:
    """Parsers for one choice; ``forced``: the reply is nothing but grammar-forced calls in the tool-call
    parser's own format (``forced_tag``), or as bare JSON objects for a format without JSON arguments;
    ``answer_format``: such calls or else an answer in the response_format (tools and a format together)."""

    def __init__(self, *, tool_parser: str | None, reasoning_parser: str | None, chat_template: str | None,
                 tool_names: set[str], forced: bool, parallel: bool, separate_reasoning: bool = True,
                 drop: tuple[str, ...] = (), answer_format: bool = False) -> None:
        self.drop = drop  # special tokens (EOS ...) the text carries because markers made us keep them
        self.reasoning: ReasoningParser | None = (
            make_reasoning_parser(reasoning_parser) if reasoning_parser and separate_reasoning else None)
        self.tools: ToolParser | None = None
        if forced or (answer_format and tool_names):
            self.tools = make_tool_parser(tool_parser or "auto", chat_template, tool_names)
            if self.tools.call_end is None:
                self.tools = BareJsonParser(tool_names)
        elif tool_names and tool_parser:
            self.tools = make_tool_parser(tool_parser, chat_template, tool_names)
        elif reasoning_parser == "gpt-oss" and separate_reasoning:
            self.tools = GptOssParser(set())  # harmony markers around the content: read it out, no calls
        self.parallel = parallel
        self.forced = forced  # the grammar allows nothing but calls: text outside them is a call cut short
        self.has_calls = False

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply as an OpenAI assistant message."""
        msg: dict[str, Any] = {"role": "assistant"}
        rest = text = self._clean(text)
        if self.reasoning is not None:
            split = self.reasoning.parse(text)
            rest = split.rest
            msg["reasoning_content"] = split.reasoning or None
        if self.tools is None:
            msg["content"] = rest
            return msg
        parsed = self.tools.parse(rest)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        msg["content"] = None if self.forced else parsed.content
        if calls:
            self.has_calls = True
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg

    def delta(self, piece: str, *, final: bool) -> dict[str, Any]:
        """The delta fields ``piece`` (the reply's newest text) makes certain."""
        out: dict[str, Any] = {}
        rest = piece = self._clean(piece)
        if self.reasoning is not None:
            split = self.reasoning.parse_delta(piece, final=final)
            rest = split.rest
            if split.reasoning:
                out["reasoning_content"] = split.reasoning
        if self.tools is None:
            if rest:
                out["content"] = rest
            return out
        d = self.tools.parse_delta(rest, final=final)
        if d.content and not self.forced:
            out["content"] = d.content
        calls = [c for c in d.tool_calls if self.parallel or c["index"] == 0]
        if calls:
            self.has_calls = True
            out["tool_calls"] = calls
        return out

    def forced_tag(self, tools: list[tuple[str, Any]]) -> dict[str, Any]:
        """The structural tag forcing calls of the (name, parameters schema) ``tools`` in this choice's format."""
        if self.tools is None:
            raise RuntimeError("forced_tag needs a tool-call parser; this choice was built without one")
        tag = self.tools.forced_tag(tools, parallel=self.parallel)
        if tag is None:  # __init__ replaces a format without JSON arguments by BareJsonParser
            raise RuntimeError(f"tool-call parser {type(self.tools).__name__} gave no structural tag for forced calls")
        return tag

    def auto_tag(self, tools: list[tuple[str, Any]]) -> dict[str, Any] | None:
        """The structural tag holding tool_choice auto calls to their schemas; None: the format has no trigger."""
        return None if self.tools is None else self.tools.auto_tag(tools, parallel=self.parallel)

    def _clean(self, text: str) -> str:
        for token in self.drop:
            text = text.replace(token, "")
        return text

    @property
    def syntax(self) -> tuple[str, ...]:
        """The markers its parsers read."""
        return (self.reasoning.syntax if self.reasoning else ()) + (self.tools.syntax if self.tools else ())


def special_tokens(tokenizer: Any) -> set[str]:
    """Strings a decode with skip_special_tokens=True would remove."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok))
    return found


def keep_special_markers(output: ChatOutput, tokenizer: Any) -> tuple[bool, tuple[str, ...]]:
    """Whether the reply must be decoded with special tokens (some marker the parsers read is one), and
    then which other special tokens (EOS, padding ...) to drop from the text before parsing."""
    special = special_tokens(tokenizer)
    needed = special & set(output.syntax)
    if not needed:
        return False, ()
    return True, tuple(sorted(special - needed, key=len, reverse=True))
