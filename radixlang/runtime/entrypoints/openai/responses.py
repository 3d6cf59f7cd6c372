"""POST /v1/responses (OpenAI Responses API) over the chat-completions machinery, whole or streamed.

A request is translated into the chat route's body (``responses_protocol.chat_body``) and served by
``serve_chat``: the same chat template, tools and tool_choice (a forced call is a structural tag),
response_format, reasoning parser and streaming. Its answer, a chat completion or its chunks, is
translated back into a Response object (``ResponseBuilder``) or the Responses event stream
(``responses_stream``). Stored responses (``store``, the default) can be continued with
``previous_response_id`` and read back with GET /v1/responses/{id}.
"""
from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlang.runtime.entrypoints.http_common import Front, error_response, parse_model
from radixlang.runtime.entrypoints.openai.responses_output import ResponseBuilder, reply_message
from radixlang.runtime.entrypoints.openai.responses_protocol import (
    ResponsesRequest, chat_body, check_unsupported, function_tools, input_messages, responses_param,
)
from radixlang.runtime.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from radixlang.runtime.entrypoints.openai.responses_stream import response_events
from radixlang.runtime.entrypoints.openai.serving import serve_chat
from radixlang.runtime.errors import RequestError


async def serve_responses(engine: Front, store: ResponseStore, body: dict[str, Any]) -> Response:
    req: ResponsesRequest = parse_model(ResponsesRequest, body)
    check_unsupported(req)
    tools = function_tools(req)
    history: list[dict[str, Any]] = []
    calls: dict[str, str] = {}
    if req.previous_response_id is not None:
        stored = store.get(req.previous_response_id)
        if stored is None:
            return error_response(404, f"previous response {req.previous_response_id!r} was not found: it was not "
                                       "stored, or the bounded store has dropped it", "previous_response_id")
        history, calls = list(stored.messages), dict(stored.calls)
    messages = history + input_messages(req.input, known_calls=calls)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    builder = ResponseBuilder(engine, req, tools)
    try:
        answer = await serve_chat(engine, chat_body(req, system + messages, tools))
    except RequestError as e:
        raise RequestError(str(e), responses_param(e.param)) from None

    def keep(response: dict[str, Any], reply: dict[str, Any] | None) -> None:
        if req.store and reply is not None:
            replied = dict(calls)
            replied.update({c["id"]: c["function"]["name"] for c in reply.get("tool_calls") or ()})
            store.put(response["id"], StoredResponse(response, messages + [reply], replied))

    if isinstance(answer, StreamingResponse):
        return StreamingResponse(response_events(builder, answer, keep), media_type="text/event-stream")
    if not isinstance(answer, JSONResponse) or answer.status_code != 200:
        return answer  # the model's 404, in OpenAI's error shape already
    completion = orjson.loads(bytes(answer.body))
    choice = completion["choices"][0]
    response = builder.response(builder.output_items(choice["message"], choice.get("logprobs")),
                                finish_reason=choice.get("finish_reason"), usage=completion.get("usage"))
    keep(response, reply_message(choice["message"]))
    return JSONResponse(response)


async def get_response(store: ResponseStore, response_id: str) -> Response:
    stored = store.get(response_id)
    if stored is None:
        return error_response(404, f"response {response_id!r} was not found", "response_id")
    return JSONResponse(stored.response)


async def delete_response(store: ResponseStore, response_id: str) -> Response:
    if not store.delete(response_id):
        return error_response(404, f"response {response_id!r} was not found", "response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
