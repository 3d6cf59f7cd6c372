"""Response objects and output items of /v1/responses, made from the chat route's answers."""
from __future__ import annotations

import time
import uuid
from typing import Any

from radixlang.runtime.entrypoints.http_common import Front, model_name
from radixlang.runtime.entrypoints.openai.responses_protocol import FunctionTool, NamedFunction, ResponsesRequest


def reply_message(message: dict[str, Any]) -> dict[str, Any]:
    """The reply as the chat message a later turn (previous_response_id) shows the model."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                             for c in message["tool_calls"]]
    elif out["content"] is None:
        out["content"] = ""
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """Response objects and output items for one request (one id, one creation time)."""

    def __init__(self, engine: Front, req: ResponsesRequest, tools: list[FunctionTool]) -> None:
        self.req, self.tools = req, tools
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.model = model_name(engine)
        self.tokenizer = engine.tokenizer

    def response(self, output: list[dict[str, Any]], *, finish_reason: str | None, usage: dict[str, Any] | None,
                 status: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        if status is None:
            status = "incomplete" if finish_reason == "length" else "completed"
        done = status in ("completed", "incomplete")
        if status == "incomplete" and output:  # the item max_output_tokens cut short
            output = output[:-1] + [{**output[-1], "status": "incomplete"}]
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        tool_choice: Any = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else (
            req.tool_choice or "auto")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if done else None, "model": self.model, "output": output,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "max_output_tokens": req.max_output_tokens, "previous_response_id": req.previous_response_id,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "top_logprobs": req.top_logprobs, "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in self.tools],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "reasoning": req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None},
            "truncation": req.truncation or "disabled", "store": req.store, "user": req.user,
            "usage": responses_usage(usage, self.reasoning_tokens(output)) if usage is not None else None,
        }

    def reasoning_tokens(self, output: list[dict[str, Any]]) -> int:
        """The reasoning's tokens, counted by tokenizing its text again (the reply's ids are not kept apart)."""
        texts = [p["text"] for o in output if o["type"] == "reasoning" for p in o["content"]]
        return sum(len(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts)

    def output_items(self, message: dict[str, Any], logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
        """A chat choice's message as Responses output items: reasoning, then text, then function calls."""
        items = []
        if message.get("reasoning_content"):
            items.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
        calls = message.get("tool_calls") or []
        content = message.get("content")
        if content or not (calls or items):  # an empty reply is still one (empty) message
            entries = (logprobs or {}).get("content") or [] if logprobs is not None else None
            items.append(message_item(new_id("msg"), content or "", "completed", entries))
        for c in calls:
            items.append(call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"],
                                   "completed"))
        return items


def message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    content = [text_part(text, logprobs)] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def responses_usage(usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "total_tokens": usage["total_tokens"]}
