"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over a ``Front``.

A request is translated into the chat route's request (``anthropic_protocol.chat_body``) and prepared by
the chat route's own ``prepare_chat`` (template, tools, forced calls as a structural tag, tokenization);
the reply's text goes through the same ``ChatOutput`` parsers and comes back as Anthropic content blocks,
whole or as Anthropic's SSE events. Every error is in Anthropic's shape.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import orjson
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlang.runtime.entrypoints.anthropic_protocol import (
    CountTokensRequest, MessagesRequest, anthropic_error, chat_body, content_blocks, error_body, stop_reason, usage,
)
from radixlang.runtime.entrypoints.http_common import (
    Front, chat_template_of, check_outputs, json_object, model_name, parse_model, unknown_model,
)
from radixlang.runtime.entrypoints.openai.chat_output import ChatOutput
from radixlang.runtime.entrypoints.openai.protocol import ChatRequest
from radixlang.runtime.entrypoints.openai.serving import PreparedChat, prepare_chat
from radixlang.runtime.errors import RequestError
from radixlang.runtime.front.tokenizer_manager import RequestStream
from radixlang.runtime.tokenizer_source import encode_chat

logger = logging.getLogger(__name__)

# sampling params named as this API names them, in the messages of errors the runtime raises
_NAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences", "input_ids": "messages", "text": "messages"}
# a grammar this API's request cannot give directly: the server built it from the tools (a forced call)
_TOOL_GRAMMARS = ("structural_tag", "constrain_after")


async def serve_messages(engine: Front, raw: bytes) -> Response:
    return await _in_anthropic_shape(_messages(engine, raw))


async def serve_count_tokens(engine: Front, raw: bytes) -> Response:
    return await _in_anthropic_shape(_count_tokens(engine, raw))


async def _in_anthropic_shape(handling: Awaitable[Response]) -> Response:
    """The route's response, its errors in Anthropic's shape (which its clients parse)."""
    try:
        return await handling
    except RequestError as e:
        return anthropic_error(400, _anthropic_message(e))
    except Exception as e:  # a server fault: a 500, logged
        logger.exception("an Anthropic route failed")
        return anthropic_error(500, f"internal error: {type(e).__name__}: {e}")


async def _count_tokens(engine: Front, raw: bytes) -> Response:
    req = parse_model(CountTokensRequest, json_object(raw))
    if (missing := _unknown_model(engine, req.model)) is not None:
        return missing
    ids, _ = _prepare(engine, req)
    return JSONResponse({"input_tokens": len(ids)})


def _anthropic_message(e: RequestError) -> str:
    """The message, its leading field renamed to this API's name (max_new_tokens -> max_tokens)."""
    message = str(e)
    param = e.param
    if param in _NAMES and message.startswith(param + " "):
        message = _NAMES[param] + message[len(param):]
    return _tools_named(message, param)


def _tools_named(message: str, param: str | None) -> str:
    return f"tools: {message}" if param in _TOOL_GRAMMARS else message


def _unknown_model(engine: Front, model: str) -> JSONResponse | None:
    if unknown_model(engine, model) is None:
        return None
    return anthropic_error(404, f"model: {model!r} is not served here: this server serves {model_name(engine)!r} "
                                "(or send 'default')")


def _prepare(engine: Front, req: MessagesRequest) -> tuple[list[int], PreparedChat]:
    """The prompt's ids (a prefill appended to the rendered template) and the chat route's preparation."""
    body, prefill = chat_body(req, native_tool_calls="tool_calls" in (chat_template_of(engine) or ""))
    chat = prepare_chat(engine, parse_model(ChatRequest, body))
    ids = encode_chat(engine.tokenizer, chat.prompt + prefill) if prefill else chat.ids
    return ids, chat


async def _messages(engine: Front, raw: bytes) -> Response:
    req = parse_model(MessagesRequest, json_object(raw))
    if (missing := _unknown_model(engine, req.model)) is not None:
        return missing
    ids, chat = _prepare(engine, req)
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    if req.stream:
        it = await engine.stream(input_ids=ids, sampling_params={**chat.params, "n": 1})
        return StreamingResponse(_events(engine, req, chat, it, msg_id, len(ids)), media_type="text/event-stream")
    out = await engine.generate(input_ids=[ids], sampling_params={**chat.params, "n": 1})
    outs = out if isinstance(out, list) else [out]
    check_outputs(outs, "messages")
    parser = chat.output()
    blocks = content_blocks(parser.message(outs[0]["text"]))
    reason, sequence = stop_reason(outs[0], tool_use=parser.has_calls, stop_sequences=req.stop_sequences)
    return JSONResponse({"id": msg_id, "type": "message", "role": "assistant", "model": model_name(engine),
                         "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
                         "usage": usage(outs[0])})


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


class _Blocks:
    """The open content block of a stream, and the events that start, fill and stop blocks."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # "text" | "thinking" | "tool_use" | None (no block open)

    def open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self.index += 1
        self.kind = kind
        return events + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def add(self, delta: dict[str, Any]) -> list[bytes]:
        """The events of one ``ChatOutput.delta``."""
        events: list[bytes] = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                events += self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.kind != "text":
                events += self.open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a new call: its block opens with an empty input, the JSON follows in pieces
                events += self.open("tool_use", {"type": "tool_use", "id": call["id"], "name": fn.get("name"),
                                                 "input": {}})
            if fn.get("arguments") and self.kind == "tool_use":
                events.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return events

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})


async def _events(engine: Front, req: MessagesRequest, chat: PreparedChat, it: RequestStream, msg_id: str,
                  prompt_tokens: int) -> AsyncIterator[bytes]:
    """Anthropic's stream: message_start, ping, content blocks, message_delta (stop reason, usage),
    message_stop; a request refused mid-stream ends with an error event. Leaving aborts the request."""
    parser: ChatOutput = chat.output()
    blocks = _Blocks()
    start: dict[str, Any] = {"id": msg_id, "type": "message", "role": "assistant", "model": model_name(engine),
                             "content": [], "stop_reason": None, "stop_sequence": None,
                             "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    try:
        yield _event("message_start", {"message": start})
        yield _event("ping", {})
        sent = 0
        async for out in it:
            reason = out["meta_info"].get("finish_reason")
            if reason is not None and reason.get("type") == "abort":
                status = reason.get("status_code") or 500
                message = _tools_named(reason.get("message") or "request aborted", reason.get("param"))
                yield b"event: error\ndata: " + orjson.dumps(error_body(status, message)) + b"\n\n"
                return
            for event in blocks.add(parser.delta(out["text"][sent:], final=reason is not None)):
                yield event
            sent = len(out["text"])
            if reason is not None:
                for event in blocks.close():
                    yield event
                stop, sequence = stop_reason(out, tool_use=parser.has_calls, stop_sequences=req.stop_sequences)
                yield _event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": sequence},
                                               "usage": usage(out)})
                yield _event("message_stop", {})
    finally:  # the client left (or the response was cancelled): abort the request if it still runs
        await it.aclose()
