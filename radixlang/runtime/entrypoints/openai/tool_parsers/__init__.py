"""Tool-call parsers, one module per output format, over ``base.ToolParser``.

``--tool-call-parser NAME`` picks one; ``auto`` finds the format whose markers the
chat template contains (``detect``), falling back to hermes (``<tool_call>``), the
format the server describes to a model whose template cannot render tools.
"""
from __future__ import annotations

from radixlang.runtime.entrypoints.openai.tool_parsers.base import Delta, ParseResult, ToolCall, ToolParser
from radixlang.runtime.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from radixlang.runtime.entrypoints.openai.tool_parsers.gpt_oss import GptOssParser
from radixlang.runtime.entrypoints.openai.tool_parsers.hermes import HermesParser
from radixlang.runtime.entrypoints.openai.tool_parsers.llama3 import Llama3JsonParser
from radixlang.runtime.entrypoints.openai.tool_parsers.mistral import MistralParser
from radixlang.runtime.entrypoints.openai.tool_parsers.pythonic import PythonicParser

__all__ = ["Delta", "ParseResult", "ToolCall", "ToolParser", "TOOL_PARSERS", "detect", "make_tool_parser"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "qwen25": HermesParser, "qwen3": HermesParser,
    "llama3": Llama3JsonParser, "mistral": MistralParser, "deepseekv3": DeepSeekV3Parser,
    "pythonic": PythonicParser, "gpt-oss": GptOssParser,
}

# in this order: a template may mention several formats' markers (deepseek's also says <think>, say)
_DETECT = (("<｜tool▁calls▁begin｜>", "deepseekv3"), ("<|channel|>", "gpt-oss"), ("[TOOL_CALLS]", "mistral"),
           ("<tool_call>", "hermes"), ("<|python_start|>", "pythonic"), ("[func_name1(", "pythonic"),
           ("<|python_tag|>", "llama3"))


def detect(chat_template: str | None) -> str:
    """The parser whose format the chat template shows; hermes when it shows none."""
    for marker, name in _DETECT:
        if chat_template and marker in chat_template:
            return name
    return "hermes"


def make_tool_parser(name: str, chat_template: str | None, tool_names: set[str] | None) -> ToolParser:
    """A fresh parser (one per choice: it keeps that choice's text); ``name`` may be ``auto``."""
    chosen = detect(chat_template) if name == "auto" else name
    if chosen not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be auto or one of {', '.join(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[chosen](tool_names)
