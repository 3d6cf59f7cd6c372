"""The Responses event stream of /v1/responses, made from the chat route's streamed chunks.

``response.created`` and ``response.in_progress`` open it; each output item (reasoning, message,
function call) is announced by ``response.output_item.added``, grows by its deltas
(``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.function_call_arguments.delta``) and ends with its ``.done`` events; ``response.completed``
(``response.incomplete`` at max_output_tokens, ``response.failed`` after an ``error`` event) carries
the whole Response with its usage. Every event has a ``sequence_number``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, AsyncIterator

import orjson
from fastapi.responses import StreamingResponse

from radixlang.runtime.entrypoints.openai.responses_output import (
    ResponseBuilder, call_item, message_item, new_id, reasoning_item, reply_message, text_part,
)
from radixlang.runtime.entrypoints.openai.responses_protocol import responses_param

Keep = Callable[[dict[str, Any], dict[str, Any] | None], None]


async def response_events(builder: ResponseBuilder, answer: StreamingResponse, keep: Keep) -> AsyncIterator[bytes]:
    """Translate the chat stream ``answer`` into Responses events; ``keep(response, reply)`` stores the
    finished response. Closing this stream closes the chat stream, which aborts the request."""
    events = _Events(builder)
    chunks = answer.body_iterator
    try:
        for event in events.start():
            yield event
        pending = b""
        async for piece in chunks:
            pending += piece if isinstance(piece, bytes) else str(piece).encode()
            while b"\n\n" in pending:
                line, pending = pending.split(b"\n\n", 1)
                if line.startswith(b"data: {"):
                    for event in events.on_chunk(orjson.loads(line[6:])):
                        yield event
        for event in events.finish():
            yield event
        keep(events.final, None if events.error else events.reply())
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]  # an async generator: aborts an unfinished request


class _Item:
    """One output item while it streams."""

    def __init__(self, index: int, item: dict[str, Any]) -> None:
        self.index, self.item, self.text, self.open = index, item, "", True
        self.logprobs: list[dict[str, Any]] = []


class _Events:
    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.seq = 0
        self.items: list[_Item] = []
        self.current: _Item | None = None
        self.calls: dict[int, _Item] = {}  # the chat stream's tool-call index -> its item
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.final: dict[str, Any] = {}

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def start(self) -> list[bytes]:
        response = self.builder.response([], finish_reason=None, usage=None, status="in_progress")
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def on_chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        if "error" in chunk:  # a refusal met mid-stream (the chat route then finishes the choice)
            err = chunk["error"]
            self.error = {"code": str(err.get("code")), "message": err.get("message") or "request refused"}
            return [self.event("error", code=self.error["code"], message=self.error["message"],
                               param=responses_param(err.get("param")))]
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self.grow("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                entries = (choice.get("logprobs") or {}).get("content")
                out += self.grow("message", delta["content"], entries)
            for call in delta.get("tool_calls") or ():
                out += self.grow_call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return out

    def grow(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        out: list[bytes] = []
        if self.current is None or self.current.item["type"] != kind:
            out += self.close_current()
            out += self.open(reasoning_item(new_id("rs"), "", "in_progress") if kind == "reasoning" else
                             message_item(new_id("msg"), "", "in_progress", None))
        item = self.opened()
        item.text += text
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", item_id=item.item["id"], output_index=item.index,
                                  content_index=0, delta=text))
        else:
            item.logprobs += logprobs or []
            out.append(self.event("response.output_text.delta", item_id=item.item["id"], output_index=item.index,
                                  content_index=0, delta=text, logprobs=logprobs or []))
        return out

    def grow_call(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        fn = call.get("function") or {}
        item = self.calls.get(call.get("index", 0))
        if item is None:
            out += self.close_current()
            out += self.open(call_item(new_id("fc"), call.get("id") or new_id("call"), fn.get("name") or "", "",
                                       "in_progress"))
            item = self.calls[call.get("index", 0)] = self.opened()
        if fn.get("arguments"):
            item.text += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item.item["id"],
                                  output_index=item.index, delta=fn["arguments"]))
        return out

    def opened(self) -> _Item:
        if self.current is None:
            raise RuntimeError("no output item is open")  # open() was just called: an internal error
        return self.current

    def open(self, item: dict[str, Any]) -> list[bytes]:
        self.current = _Item(len(self.items), item)
        self.items.append(self.current)
        out = [self.event("response.output_item.added", output_index=self.current.index, item=item)]
        part = {"message": text_part("", None), "reasoning": {"type": "reasoning_text", "text": ""}}.get(item["type"])
        if part is not None:
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.current.index,
                                  content_index=0, part=part))
        return out

    def close_current(self) -> list[bytes]:
        item, self.current = self.current, None
        if item is None or not item.open:
            return []
        item.open = False
        kind, ids = item.item["type"], {"item_id": item.item["id"], "output_index": item.index}
        out = []
        if kind == "message":
            part = text_part(item.text, item.logprobs)
            out.append(self.event("response.output_text.done", **ids, content_index=0, text=item.text,
                                  logprobs=item.logprobs))
            out.append(self.event("response.content_part.done", **ids, content_index=0, part=part))
            item.item = message_item(item.item["id"], item.text, "completed", item.logprobs)
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": item.text}
            out.append(self.event("response.reasoning_text.done", **ids, content_index=0, text=item.text))
            out.append(self.event("response.content_part.done", **ids, content_index=0, part=part))
            item.item = reasoning_item(item.item["id"], item.text, "completed")
        else:
            out.append(self.event("response.function_call_arguments.done", **ids, arguments=item.text,
                                  name=item.item["name"]))
            item.item = call_item(item.item["id"], item.item["call_id"], item.item["name"], item.text, "completed")
        out.append(self.event("response.output_item.done", output_index=item.index, item=item.item))
        return out

    def finish(self) -> list[bytes]:
        out = self.close_current()
        if not self.items and self.error is None:  # an empty reply is still one (empty) message, as unstreamed
            out += self.open(message_item(new_id("msg"), "", "in_progress", None))
            out += self.close_current()
        output = [item.item for item in self.items]
        if self.error is not None:
            self.final = self.builder.response(output, finish_reason=None, usage=self.usage, status="failed",
                                               error=self.error)
            return out + [self.event("response.failed", response=self.final)]
        self.final = self.builder.response(output, finish_reason=self.finish_reason, usage=self.usage)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return out + [self.event(kind, response=self.final)]

    def reply(self) -> dict[str, Any]:
        """The reply as one chat message, for the store."""
        text = "".join(i.text for i in self.items if i.item["type"] == "message")
        calls = [{"id": i.item["call_id"], "function": {"name": i.item["name"], "arguments": i.text}}
                 for i in self.items if i.item["type"] == "function_call"]
        return reply_message({"content": text or None, "tool_calls": calls})
