"""OpenAI-compatible requests and responses: /v1/completions and /v1/chat/completions.

Requests are pydantic models that forbid unknown fields (as OpenAI does), so a
bad field is a 400 naming it. ``to_sampling`` maps one onto SGLang sampling
params; response_format becomes a json_schema constraint (a forced tool_choice a structural tag, made by
the serving layer in the tool-call parser's format).
"""
from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixlang.constrained.json_regex import ANY_JSON_MARKER
from radixlang.runtime.errors import RequestError

_STRICT = ConfigDict(extra="forbid", strict=True)
_TOOL_CALL_OPEN, _TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    function: dict[Literal["name"], str]


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama.cpp's json_object + schema
    # type structural_tag (SGLang / xgrammar): free text, and after a trigger begin + schema body + end
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both routes share; SGLang's extra body fields (regex, json_schema, top_k ...) included."""
    model_config = _STRICT
    model: str | None = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    rid: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # SGLang extensions
    chat_template_kwargs: dict[str, Any] | None = None  # passed to apply_chat_template (e.g. enable_thinking)
    separate_reasoning: bool = True  # with --reasoning-parser: reasoning_content apart from content


_SGLANG_PASSTHROUGH = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "top_k", "min_p",
                       "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens", "no_stop_trim",
                       "regex", "json_schema", "ebnf", "stop_regex", "logit_bias")


def to_sampling(req: CompletionRequest | ChatRequest, constraint: tuple[str, str] | None) -> dict[str, Any]:
    """SGLang sampling params for one choice (n is expanded by the caller); ``constraint``: the
    (sampling param, value) that response_format or a forced tool call imposes."""
    params: dict[str, Any] = {name: getattr(req, name) for name in _SGLANG_PASSTHROUGH
                              if getattr(req, name) is not None}
    max_tokens = getattr(req, "max_completion_tokens", None)
    max_tokens = req.max_tokens if max_tokens is None else max_tokens
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    if req.min_tokens is not None:
        params["min_new_tokens"] = req.min_tokens
    if req.stop is not None:
        params["stop"] = req.stop
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    if constraint is not None:
        given = [name for name in ("regex", "json_schema", "ebnf") if name in params]
        if given:
            raise RequestError(f"{given[0]} cannot be combined with response_format or tool_choice", given[0])
        params[constraint[0]] = constraint[1]
    tag = structural_tag_constraint(req)
    if tag is not None:
        given = [name for name in ("regex", "json_schema", "ebnf") if name in params]
        if given:
            raise RequestError(f"{given[0]} cannot be combined with a structural_tag response_format", given[0])
        params["structural_tag"] = tag
    return params


# ---- response_format structural_tag (grammar side; checked in full by the grammar compiler) ----------
def structural_tag_constraint(req: CompletionRequest | ChatRequest) -> str | None:
    """The structural_tag sampling param a ``response_format: {"type": "structural_tag"}`` asks for."""
    fmt = getattr(req, "response_format", None)
    if fmt is None or fmt.type != "structural_tag":
        return None
    if not fmt.structures or not fmt.triggers:
        raise RequestError("response_format of type structural_tag needs structures and triggers",
                           "response_format")
    return json.dumps({"type": "structural_tag", "structures": fmt.structures, "triggers": fmt.triggers})




# ---- chat: prompt, constraint, tool calls ---------------------------------------------------------
def active_tools(req: ChatRequest) -> list[Tool]:
    if not req.tools or req.tool_choice == "none":
        return []
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.get("name")
        chosen = [t for t in req.tools if t.function.name == name]
        if not chosen:
            raise RequestError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return chosen
    return list(req.tools)


def chat_constraint(req: ChatRequest, tools: list[Tool]) -> tuple[str, str] | None:
    """("json_schema", schema) that response_format imposes, or None (a forced tool call's structural tag
    is made by the serving layer, in the tool-call parser's format)."""
    if req.tool_choice is not None and req.tool_choice not in ("none", "auto") and not req.tools:
        raise RequestError("tool_choice needs tools", "tool_choice")
    forced = bool(tools) and req.tool_choice not in (None, "auto")
    fmt = req.response_format
    if forced and fmt is not None and fmt.type != "text":
        raise RequestError("response_format cannot be combined with a forced tool_choice", "response_format")
    if forced:
        return None
    if fmt is None or fmt.type in ("text", "structural_tag"):
        return None
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise RequestError("response_format of type json_schema needs a json_schema object", "response_format")
        schema = fmt.json_schema.schema_
    else:
        schema = fmt.schema_
    return ("json_schema", ANY_JSON_MARKER if schema is None else json.dumps(schema))


def chat_prompt(tokenizer: Any, req: ChatRequest, tools: list[Tool], template: str | None = None, *,
                call_format: str = _TOOL_CALL_OPEN + '{"name": NAME, "arguments": {...}}' + _TOOL_CALL_CLOSE,
                add_generation_prompt: bool = True) -> str:
    """The prompt text; ``template`` (--chat-template's text) replaces the tokenizer's chat template;
    ``call_format`` is how the tool-call parser in use expects a call (told when the template has no tools)."""
    template = template or getattr(tokenizer, "chat_template", None)
    native = "tool_calls" in (template or "")  # the template renders assistant tool calls itself
    messages = [_message(i, m, native_tool_calls=native) for i, m in enumerate(req.messages)]
    if tools and "tools" not in (template or ""):
        # the template cannot render tools: describe them and the call format in a system message
        spec = json.dumps([t.function.model_dump(exclude_none=True) for t in tools])
        note = f"You may call these functions: {spec}\nTo call one, reply with {call_format}"
        messages.insert(0, {"role": "system", "content": note})
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & {"conversation", "tools", "tokenize", "add_generation_prompt", "chat_template",
                                     "return_dict", "return_tensors"})
    if reserved:
        raise RequestError(f"chat_template_kwargs must not set {reserved[0]}", "chat_template_kwargs")
    if tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    if template is not None:
        kwargs["chat_template"] = template
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except Exception as e:  # jinja raises its own errors for message orders a template refuses
        raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from None


def _message(i: int, m: dict[str, Any], *, native_tool_calls: bool = False) -> dict[str, Any]:
    role, content = m.get("role"), m.get("content")
    calls = m.get("tool_calls") if role == "assistant" else None
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(f"messages[{i}].role must be system, developer, user, assistant or tool, got {role!r}",
                         "messages")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise RequestError(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}", "messages")
        content = "".join(p["text"] for p in content)
    elif content is None and role == "assistant":
        content = "" if native_tool_calls else "".join(
            f"{_TOOL_CALL_OPEN}{json.dumps(c.get('function'))}{_TOOL_CALL_CLOSE}"
            for c in calls or [] if isinstance(c, dict))
    if not isinstance(content, str):
        raise RequestError(f"messages[{i}].content must be a string or a list of text parts", "messages")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if calls and native_tool_calls:
        out["tool_calls"] = [_history_call(i, c) for c in calls]
    if role == "tool":
        out.update({k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)})
    return out


def _history_call(i: int, call: Any) -> dict[str, Any]:
    """An earlier assistant tool call for the template, its arguments as an object (templates print them)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"messages[{i}].tool_calls entries need function.name", "messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise RequestError(f"messages[{i}].tool_calls arguments must be JSON, got {args!r}", "messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


# ---- responses ----------------------------------------------------------------------------------
def finish_reason(out: dict[str, Any], *, tool_calls: bool = False) -> str | None:
    reason = out["meta_info"].get("finish_reason")
    if reason is None:
        return None
    if tool_calls:
        return "tool_calls"
    return {"length": "length", "stop": "stop"}.get(reason.get("type"), "abort")


def usage(outs_per_prompt: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per choice); completion tokens per choice."""
    prompt = sum(group[0]["meta_info"]["prompt_tokens"] for group in outs_per_prompt)
    cached = sum(group[0]["meta_info"].get("cached_tokens", 0) for group in outs_per_prompt)
    completion = sum(o["meta_info"].get("completion_tokens", 0) for group in outs_per_prompt for o in group)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# a token the grammar forbids has logprob -inf, which JSON cannot carry: reported as this floor, as vLLM does
_LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, _LOGPROB_FLOOR)


def chat_logprobs(tokenizer: Any, out: dict[str, Any], start: int = 0) -> dict[str, Any]:
    entries = []
    tops = out["meta_info"].get("output_top_logprobs") or []
    for k, (lp, tid, _) in enumerate(out["meta_info"].get("output_token_logprobs", [])[start:], start):
        token = tokenizer.decode([tid])
        row = tops[k] if k < len(tops) and tops[k] else []
        entries.append({"token": token, "logprob": _finite(lp), "bytes": list(token.encode()),
                        "top_logprobs": [{"token": (t := tokenizer.decode([i])), "logprob": _finite(v),
                                          "bytes": list(t.encode())} for v, i, _ in row]})
    return {"content": entries}


def completion_logprobs(tokenizer: Any, out: dict[str, Any], start: int = 0, offset: int = 0) -> dict[str, Any]:
    tokens, values, tops, offsets = [], [], [], []
    rows = out["meta_info"].get("output_top_logprobs") or []
    for k, (lp, tid, _) in enumerate(out["meta_info"].get("output_token_logprobs", [])[start:], start):
        token = tokenizer.decode([tid])
        tokens.append(token)
        values.append(_finite(lp))
        offsets.append(offset)
        offset += len(token)
        row = rows[k] if k < len(rows) and rows[k] else []
        tops.append({tokenizer.decode([i]): _finite(v) for v, i, _ in row})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(tokenizer: Any, out: dict[str, Any], completion: dict[str, Any]) -> dict[str, Any]:
    """echo with logprobs: the prompt tokens' entries (the first one's logprob null) before ``completion``'s."""
    tokens, values, tops, offsets = [], [], [], []
    rows = out["meta_info"].get("input_top_logprobs") or []
    offset = 0
    for k, (lp, tid, *_) in enumerate(out["meta_info"].get("input_token_logprobs") or []):
        token = tokenizer.decode([tid])
        tokens.append(token)
        values.append(lp)
        offsets.append(offset)
        offset += len(token)
        row = rows[k] if k < len(rows) else None
        tops.append(None if row is None else {tokenizer.decode([i]): v for v, i, *_ in row})
    return {"tokens": tokens + completion["tokens"], "token_logprobs": values + completion["token_logprobs"],
            "top_logprobs": tops + completion["top_logprobs"], "text_offset": offsets + completion["text_offset"]}


def envelope(*, chat: bool, model: str, rid: str, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}
