"""Tool calls held to their tools' schemas on the chat route, beyond a forced tool_choice.

- ``tool_choice: "auto"`` (or none given): the reply is free text, but once the model writes its
  format's call trigger (``<tool_call>`` for hermes ...) the rest of the call is held to the tools'
  schemas by a call-block structural tag (``ToolParser.auto_tag``), so every call the parser reads
  back parses and validates. A trigger that is a special token of the model's tokenizer (Llama 3.1's
  ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``) is that token in the grammar, on llguidance, which
  names tokens by id. gpt-oss's harmony markers as special tokens (written inside calls and between
  them) make the free text harmony messages framed by those tokens, and a call a commentary message
  to a listed tool (``GptOssParser.harmony_tag``, llguidance only). Refused with a 400 that names them:
  a format without a trigger (pythonic), a grammar backend without triggered tags (outlines), markers
  that are special tokens on xgrammar, and any other format whose markers beyond the trigger are
  special tokens; ``--disable-tool-call-constraint`` goes back to parsing calls as written. A request's own grammar
  (regex, json_schema, ebnf, a structural_tag response_format) replaces the constraint: the caller
  chose the reply's shape.
- tools together with a ``json_schema`` / ``json_object`` response_format: the reply is either calls
  in the format (one unless ``parallel_tool_calls: true``, as a forced call) or an answer in the
  format: a forced structural tag with ``answer_schema``.
"""
from __future__ import annotations

import json
from collections.abc import Set
from typing import Any

from radixlang.constrained.json_regex import ANY_JSON_MARKER
from radixlang.runtime.entrypoints.openai.chat_output import ChatOutput
from radixlang.runtime.entrypoints.openai.protocol import ChatRequest, Tool
from radixlang.runtime.entrypoints.openai.tool_parsers import detect
from radixlang.runtime.entrypoints.openai.tool_parsers.gpt_oss import GptOssParser
from radixlang.runtime.errors import RequestError

_LIBRARY_BACKENDS = ("llguidance", "xgrammar")


def _auto_choice(req: Any, tools: list[Tool]) -> bool:
    return bool(tools) and isinstance(req, ChatRequest) and req.tool_choice in (None, "auto")


def answers_in_format(req: Any, tools: list[Tool]) -> bool:
    """Tools in auto mode with a JSON response_format: a call, or an answer in the format."""
    fmt = getattr(req, "response_format", None)
    return _auto_choice(req, tools) and fmt is not None and fmt.type in ("json_schema", "json_object")


def holds_auto_calls(req: Any, tools: list[Tool], *, disabled: bool) -> bool:
    """Whether tool_choice auto calls are held to their schemas (no grammar of the caller's own, flag unset)."""
    if disabled or not _auto_choice(req, tools) or answers_in_format(req, tools):
        return False
    fmt = req.response_format
    own = (req.regex, req.json_schema, req.ebnf)
    return all(g is None for g in own) and (fmt is None or fmt.type == "text")


def answer_constraint(probe: ChatOutput, tools: list[Tool], constraint: tuple[str, str]) -> tuple[str, str]:
    """The forced tag of the tools' calls, or an answer of the response_format's schema (``constraint``)."""
    tag = probe.forced_tag(_schemas(tools))
    spec = constraint[1]
    tag["answer_schema"] = {"type": "object"} if spec == ANY_JSON_MARKER else json.loads(spec)
    return ("structural_tag", json.dumps(tag))


def auto_call_constraint(probe: ChatOutput, tools: list[Tool], *, tool_call_parser: str, chat_template: str | None,
                         grammar_backend: str, special: Set[str] = frozenset()) -> str:
    """The structural_tag param holding auto-mode calls; RequestError naming what cannot hold them."""
    parser = tool_call_parser if tool_call_parser != "auto" else detect(chat_template)
    how = ("start the server with --disable-tool-call-constraint to parse calls as written, or ask for a call "
           "with tool_choice required")
    if grammar_backend not in _LIBRARY_BACKENDS:
        raise RequestError(f"tool_choice auto holds each tool call to its schema with a triggered structural tag, "
                           f"which the {grammar_backend} grammar backend cannot run (llguidance and xgrammar "
                           f"can); {how}", "tool_choice")
    tag = probe.auto_tag(_schemas(tools))
    if tag is None:
        raise RequestError(f"tool_choice auto cannot hold {parser} tool calls to their schemas: the {parser} "
                           f"format has no start marker a grammar can wait for; {how}", "tool_choice")
    markers = sorted(special & set(probe.tools.syntax if probe.tools is not None else ()))
    if not markers:
        return json.dumps(tag)
    harmony = isinstance(probe.tools, GptOssParser)
    if markers != tag["triggers"] and not harmony:
        raise RequestError(f"tool_choice auto cannot hold {parser} tool calls to their schemas with this "
                           f"tokenizer: the format's markers {', '.join(markers)} are special tokens, and a "
                           f"call-block grammar can take a special token only as the call's trigger; {how}",
                           "tool_choice")
    if grammar_backend != "llguidance":
        what = "harmony markers" if harmony else "call trigger"
        raise RequestError(f"tool_choice auto cannot hold {parser} tool calls to their schemas on the "
                           f"{grammar_backend} grammar backend: the {what} {', '.join(markers)} "
                           f"{'is a special token' if len(markers) == 1 else 'are special tokens'} of this "
                           f"tokenizer, which only llguidance grammars can name; run the server with "
                           f"--grammar-backend llguidance, or {how}", "tool_choice")
    if isinstance(probe.tools, GptOssParser):  # the messages around the calls are framed by special tokens
        return json.dumps(probe.tools.harmony_tag(_schemas(tools), parallel=probe.parallel))
    return json.dumps(tag)


def _schemas(tools: list[Tool]) -> list[tuple[str, Any]]:
    return [(t.function.name, t.function.parameters) for t in tools]
