"""Anthropic Messages API shapes: the /v1/messages request, its translation into a chat request, and the
reply's content blocks, stop reason, usage and errors.

The request is checked here (pydantic, strict types) and translated into the OpenAI chat body the chat
route takes, so both routes render, constrain and parse a conversation the same way: ``system`` becomes
a system message, ``tool_use`` blocks assistant tool calls, ``tool_result`` blocks tool messages,
``tools`` functions, ``tool_choice`` {auto, any, tool, none} OpenAI's {auto, required, named, none}.
A final assistant message is a prefill: the reply continues it.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from radixlang.runtime.entrypoints.openai.protocol import _TOOL_CALL_CLOSE, _TOOL_CALL_OPEN
from radixlang.runtime.errors import RequestError

_STRICT = ConfigDict(extra="forbid", strict=True)

# Anthropic's error type for each status this server answers with
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> JSONResponse:
    """Anthropic's error body: ``{"type": "error", "error": {"type": ..., "message": ...}}``."""
    return JSONResponse(error_body(status, message), status_code=status)


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicTool(BaseModel):
    """A client tool; server tools (bash_20250124, web_search ...) run at Anthropic, not here."""
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(BaseModel):
    """POST /v1/messages. Fields Anthropic's API has but a local model has no use for (metadata, thinking,
    service_tier ...) are accepted and ignored, so that agents which send them work; unknown ones are a 400."""
    model_config = _STRICT
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    # accepted, ignored
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a messages request without max_tokens."""
    max_tokens: int | None = Field(default=None, ge=1)  # type: ignore[assignment]


# ---- request -> chat body ------------------------------------------------------------------------------
def chat_body(req: MessagesRequest, *, native_tool_calls: bool) -> tuple[dict[str, Any], str]:
    """The OpenAI chat body ``req`` amounts to, and the prefill text (a final assistant message, which the
    reply continues; "" without one). ``native_tool_calls``: the chat template renders assistant tool calls
    itself (else a turn's calls are written out as text after its words)."""
    messages: list[dict[str, Any]] = []
    system = _system_text(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages that answer them
    for i, m in enumerate(req.messages):
        messages.extend(_turn(i, m, names, native_tool_calls=native_tool_calls))
    prefill = ""
    if req.messages[-1].get("role") == "assistant":
        last = messages.pop()
        if last.get("tool_calls") or not isinstance(last.get("content"), str):
            raise RequestError(f"messages.{len(req.messages) - 1}: a final assistant message (a prefill) must "
                               "hold text only", "messages")
        prefill = last["content"]
    if not any(m["role"] != "system" for m in messages):
        raise RequestError("messages: the conversation needs a user message", "messages")
    body: dict[str, Any] = {"messages": messages, "max_tokens": req.max_tokens}
    for ours, theirs in (("stop", "stop_sequences"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k")):
        if getattr(req, theirs) is not None:
            body[ours] = getattr(req, theirs)
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}} for t in req.tools]
    if req.tool_choice is not None:
        body.update(_tool_choice(req.tool_choice, has_tools=bool(req.tools)))
    return body, prefill


def _system_text(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n\n".join(_text_block(b, f"system.{j}") for j, b in enumerate(system))


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise RequestError(f"{where}: expected a text block {{'type': 'text', 'text': str}}, got {block!r:.80}",
                           where.split(".")[0])
    return block["text"]


def _turn(i: int, m: Any, names: dict[str, str], *, native_tool_calls: bool) -> list[dict[str, Any]]:
    """The chat messages of Anthropic message ``i`` (a user turn's tool results become tool messages)."""
    where = f"messages.{i}"
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object with role and content, got {m!r:.80}", "messages")
    if m.get("role") not in ("user", "assistant"):
        raise RequestError(f"{where}.role must be 'user' or 'assistant', got {m.get('role')!r}", "messages")
    role, content = m["role"], m.get("content")
    extra = set(m) - {"role", "content"}
    if extra:
        raise RequestError(f"{where}.{sorted(extra)[0]}: extra inputs are not permitted", "messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content blocks", "messages")
    if role == "assistant":
        return [_assistant(where, content, names, native_tool_calls=native_tool_calls)]
    out: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            out.append(_tool_result(f"{where}.content.{j}", block, names))
        elif kind == "text":
            text = _text_block(block, f"{where}.content.{j}")
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n\n" + text
            else:
                out.append({"role": "user", "content": text})
        else:
            raise RequestError(f"{where}.content.{j}.type: {kind!r} blocks are not supported in a user turn "
                               "(text and tool_result are)", "messages")
    return out


def _assistant(where: str, content: list[Any], names: dict[str, str], *, native_tool_calls: bool) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    inputs: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, f"{where}.content.{j}"))
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input")
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, dict)):
                raise RequestError(f"{where}.content.{j}: a tool_use block needs id (str), name (str) and input "
                                   "(object)", "messages")
            names[call_id] = name
            inputs.append(args)
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning is not shown to the model again, as chat templates drop it
        else:
            raise RequestError(f"{where}.content.{j}.type: {kind!r} blocks are not supported in an assistant "
                               "turn (text, tool_use and thinking are)", "messages")
    text = "".join(texts)
    if not calls:
        return {"role": "assistant", "content": text}
    if native_tool_calls or not text:
        return {"role": "assistant", "content": text or None, "tool_calls": calls}
    # the template cannot render calls: after the words, as the chat route writes calls it cannot render
    written = "".join(f"{_TOOL_CALL_OPEN}{json.dumps({'name': c['function']['name'], 'arguments': args})}"
                      f"{_TOOL_CALL_CLOSE}" for c, args in zip(calls, inputs))
    return {"role": "assistant", "content": text + written}


def _tool_result(where: str, block: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise RequestError(f"{where}.tool_use_id must be a string", "messages")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n\n".join(_text_block(b, f"{where}.content.{k}") for k, b in enumerate(content))
    if not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text blocks", "messages")
    if block.get("is_error") is True:
        content = f"Error: {content}"
    out = {"role": "tool", "tool_call_id": call_id, "content": content}
    if call_id in names:
        out["name"] = names[call_id]
    return out


def _tool_choice(choice: ToolChoice, *, has_tools: bool) -> dict[str, Any]:
    if choice.type == "tool" and not choice.name:
        raise RequestError("tool_choice.name is required when tool_choice.type is 'tool'", "tool_choice")
    if choice.type != "tool" and choice.name is not None:
        raise RequestError(f"tool_choice.name is only allowed with type 'tool', got type {choice.type!r}",
                           "tool_choice")
    if choice.type in ("any", "tool") and not has_tools:
        raise RequestError(f"tool_choice.type {choice.type!r} needs tools", "tool_choice")
    if not has_tools:
        return {}
    out: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
                           or {"type": "function", "function": {"name": choice.name}}}
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


# ---- reply -----------------------------------------------------------------------------------------------
def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI assistant message (``ChatOutput.message``) as Anthropic content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    return blocks or [{"type": "text", "text": ""}]


def stop_reason(out: dict[str, Any], *, tool_use: bool, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output; a call cut short by max_tokens is max_tokens, as
    Anthropic reports it (its input is incomplete JSON)."""
    reason = out["meta_info"].get("finish_reason") or {}
    if reason.get("type") == "length":
        return "max_tokens", None
    if tool_use:
        return "tool_use", None
    matched = reason.get("matched")
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def usage(out: dict[str, Any]) -> dict[str, Any]:
    """Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens is the whole prompt."""
    meta = out["meta_info"]
    cached = meta.get("cached_tokens", 0)
    return {"input_tokens": meta["prompt_tokens"] - cached, "output_tokens": meta.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
