"""OpenAI Responses API requests (/v1/responses) and their translation into a chat-completions body.

A Responses request is served by the chat route's machinery: its input items become chat messages
(function_call items an assistant message's tool_calls, function_call_output items tool messages),
``instructions`` a system message, ``text.format`` a response_format, function tools chat tools.
Fields the OpenAI clients send that do not change the reply here (include, metadata, user,
prompt_cache_key ...) are accepted; fields that would change its meaning and are not served
(background, conversation, prompt, truncation "auto", non-function tools) are a 400 naming the field.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixlang.runtime.errors import RequestError

_STRICT = ConfigDict(extra="forbid", strict=True)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# chat-route field names a refusal may carry -> the Responses request's own
_RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens",
                    "max_completion_tokens": "max_output_tokens", "response_format": "text",
                    "logprobs": "include", "stream_options": "stream"}


def responses_param(chat_param: str | None) -> str | None:
    """The Responses field a refusal of the chat route's ``chat_param`` is about."""
    return _RESPONSES_NAMES.get(chat_param or "", chat_param)


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class NamedFunction(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models; nothing to do here


class Reasoning(BaseModel):
    model_config = _STRICT
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: there is nothing to obfuscate
    store: bool = True
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    # meaning-changing features this server does not have: accepted only when absent / off
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    max_tool_calls: int | None = None
    # radixlang / SGLang extensions, as on the chat route
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def check_unsupported(req: ResponsesRequest) -> None:
    """Refuse, naming the field, what would change the reply's meaning and is not served."""
    if req.background:
        raise RequestError("background=true is not supported: responses are served in the foreground", "background")
    for name in ("conversation", "prompt", "context_management"):
        if getattr(req, name) is not None:
            raise RequestError(f"{name} is not supported by this server", name)
    if req.truncation == "auto":
        raise RequestError("truncation='auto' is not supported: an input over the context is refused", "truncation")
    if req.max_tool_calls is not None:
        raise RequestError("max_tool_calls is not supported", "max_tool_calls")
    if req.input is None and req.previous_response_id is None:
        raise RequestError("input is required", "input")


def function_tools(req: ResponsesRequest) -> list[FunctionTool]:
    tools = []
    for i, raw in enumerate(req.tools or []):
        if raw.get("type") != "function":
            raise RequestError(f"tools[{i}].type must be 'function' (the only tools served here), "
                               f"got {raw.get('type')!r}", "tools")
        try:
            tools.append(FunctionTool.model_validate(raw))
        except ValueError as e:
            raise RequestError(f"tools[{i}] is not a function tool: {e}", "tools") from None
    return tools


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]], tools: list[FunctionTool]) -> dict[str, Any]:
    """The /v1/chat/completions body that serves ``req`` over ``messages`` (history, instructions and input)."""
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    if req.model is not None:
        body["model"] = req.model
    if req.stream:
        body["stream_options"] = {"include_usage": True}  # the usage of response.completed
    copied = {"max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
              "parallel_tool_calls": req.parallel_tool_calls, "seed": req.seed, "stop": req.stop,
              "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
              "chat_template_kwargs": req.chat_template_kwargs}
    body.update({k: v for k, v in copied.items() if v is not None})
    if tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude_none=True, include={"name", "description", "parameters", "strict"})} for t in tools]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if tools and req.tool_choice not in (None, "auto", "none"):
        fmt = None  # a forced call is the whole reply: the text format has no text to shape (the Agents SDK sends both)
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise RequestError("text.format of type json_schema needs a schema", "text")
        spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
        spec.update({k: v for k, v in (("description", fmt.description), ("strict", fmt.strict)) if v is not None})
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if LOGPROBS_INCLUDE in (req.include or ()):
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    return body


# ---- input items -> chat messages ----------------------------------------------------------------
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def input_messages(input_: str | list[dict[str, Any]] | None, *, known_calls: dict[str, str]) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input``; ``known_calls`` (call_id -> name, from the history)
    is extended with the calls met here, so a function_call_output's tool message carries its name."""
    if input_ is None:
        return []
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(input_):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{i}]"
        if kind == "message":
            messages.append(_message(where, item))
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, str):
                raise RequestError(f"{where}: a function_call needs string name, call_id and arguments", "input")
            known_calls[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text and its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise RequestError(f"{where}: a function_call_output needs a string call_id", "input")
            tool: dict[str, Any] = {"role": "tool", "tool_call_id": call_id,
                                    "content": _text(where, item.get("output"), "output")}
            if call_id in known_calls:
                tool["name"] = known_calls[call_id]
            messages.append(tool)
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again, as chat templates drop it
        else:
            raise RequestError(f"{where}.type {kind!r} is not supported: send message, function_call, "
                               "function_call_output or reasoning items", "input")
    return messages


def _message(where: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestError(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
    return {"role": role, "content": _text(where, item.get("content"), "content")}


def _text(where: str, content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}.{field}[{k}] must be a text part (input_text / output_text), got "
                                   f"{kind!r}: this server reads text only", "input")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where}.{field} must be a string or a list of text parts", "input")
