"""FastAPI app: SGLang-native routes and the OpenAI-compatible subset, over a ``Front``.

The app serves whatever implements ``Front``: in the server that is the
TokenizerManager, which talks to the scheduler and detokenizer processes over ZMQ.
Every front call is a coroutine, so the event loop keeps serving while requests run.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlang.runtime.entrypoints.http_common import (
    Front, GenerateRequest, chat_template_of, check_outputs, error_response,
    fill_logprob_text, install_error_handlers, json_object, model_name, parse_model,
)
from radixlang.runtime.entrypoints.anthropic import serve_count_tokens, serve_messages
from radixlang.runtime.entrypoints.anthropic_protocol import anthropic_error
from radixlang.runtime.entrypoints.embeddings import add_embedding_routes
from radixlang.runtime.entrypoints.metrics import make_registry, render
from radixlang.runtime.entrypoints.openai.responses import delete_response, get_response, serve_responses
from radixlang.runtime.entrypoints.openai.responses_store import ResponseStore
from radixlang.runtime.entrypoints.openai.serving import serve_chat, serve_completions
from radixlang.runtime.entrypoints.smg_routes import add_smg_routes
from radixlang.runtime.entrypoints.tokenize_routes import add_tokenize_routes
from radixlang.runtime.errors import RequestError
from radixlang.runtime.front.tokenizer_manager import RequestStream

logger = logging.getLogger(__name__)


def create_app(engine: Front) -> FastAPI:
    args = engine.server_args
    app = FastAPI(title="radixlang")
    install_error_handlers(app)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        # each API's clients parse its own error shape: Anthropic's for /v1/messages
        fail = anthropic_error if request.url.path.startswith("/v1/messages") else error_response
        if engine.draining:
            return fail(503, "the server is shutting down")
        if args.api_key and request.url.path != "/health" and not _authorized(request, args.api_key):
            return fail(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > args.max_request_body_bytes:
            return fail(413, f"request body over {args.max_request_body_bytes} bytes")
        return await call_next(request)

    async def body_of(request: Request) -> dict[str, Any]:
        return json_object(await request.body())

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(Exception)
    async def on_internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}: {exc}",
                                       "type": "internal_error", "param": None, "code": 500}}, status_code=500)

    if args.enable_metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            info = await engine.get_server_info()
            body = render(make_registry(lambda: info))
            return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        out = await engine.generate(input_ids=[1], sampling_params={"max_new_tokens": 1},
                                    embedding=args.is_embedding)
        return Response(status_code=200 if out["meta_info"]["finish_reason"]["type"] != "abort" else 503)

    @app.get("/model_info")  # SGLang's current name; SMG reads it
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path,
                "is_generation": not args.is_embedding, "chat_template": chat_template_of(engine),
                "default_sampling_params": engine.sampling_defaults}

    @app.get("/server_info")  # SGLang's current name; SMG probes it to tell an SGLang worker from a vLLM one
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return await engine.get_server_info()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = await engine.flush_cache()
        if not ok:
            return error_response(400, "cannot flush the cache while requests are running")
        return JSONResponse({"success": True, "message": "cache flushed"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise RequestError("rid must be a string", "rid")
        engine.abort_request(rid)
        return {"success": True}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await until_disconnected(request, _generate(request, await body_of(request)))

    async def _generate(request: Request, body: dict[str, Any]) -> Response:
        req = parse_model(GenerateRequest, body)
        kw = {"prompt": req.text, "input_ids": req.input_ids, "sampling_params": req.sampling_params,
              "return_logprob": req.return_logprob, "logprob_start_len": req.logprob_start_len,
              "top_logprobs_num": req.top_logprobs_num, "rid": req.rid, "lora_path": req.lora_path}
        with_text = req.return_logprob and req.return_text_in_logprobs

        def finish(o: dict[str, Any]) -> dict[str, Any]:
            return fill_logprob_text(engine.tokenizer, o) if with_text else o

        if req.stream:
            it = await engine.stream(**kw)
            return StreamingResponse(_sse(request, it, finish), media_type="text/event-stream")
        out = await engine.generate(**kw)
        outs = out if isinstance(out, list) else [out]
        check_outputs(outs, "text" if req.text is not None else "input_ids")
        for o in outs:
            finish(o)
        return Response(orjson.dumps(out), media_type="application/json")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = model_name(engine)
        adapters = [{"id": name, "object": "model", "owned_by": "radixlang", "parent": base, "root": path}
                    for name, path in sorted(engine.lora_adapters.items())]
        return {"object": "list", "data": [{"id": base, "object": "model", "owned_by": "radixlang"}, *adapters]}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        for field_name, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise RequestError(f"{field_name} must be a non-empty string", field_name)
        return _lora_reply(*await engine.update_lora(name, path), param="lora_path")

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        name = (await body_of(request)).get("lora_name")
        if not isinstance(name, str) or not name:
            raise RequestError("lora_name must be a non-empty string", "lora_name")
        return _lora_reply(*await engine.update_lora(name, None), param="lora_name")

    def _lora_reply(success: bool, message: str, *, param: str) -> Response:
        if not success:
            raise RequestError(message, param)
        return Response(orjson.dumps({"success": True, "message": message,
                                      "loaded_adapters": engine.lora_adapters}), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await until_disconnected(request, serve_completions(engine, await body_of(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await until_disconnected(request, serve_chat(engine, await body_of(request)))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await until_disconnected(request, serve_messages(engine, await request.body()))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await serve_count_tokens(engine, await request.body())

    add_tokenize_routes(app, engine)
    add_embedding_routes(app, engine)
    add_smg_routes(app, engine)

    responses = ResponseStore()  # store / previous_response_id: bounded, in this process's memory

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await until_disconnected(request, serve_responses(engine, responses, await body_of(request)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return await get_response(responses, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str) -> Response:
        return await delete_response(responses, response_id)

    return app


def _authorized(request: Request, key: str) -> bool:
    """The key as OpenAI clients send it (Authorization: Bearer) or as Anthropic's do (x-api-key)."""
    bearer = request.headers.get("authorization", "").encode()
    api_key = request.headers.get("x-api-key", "").encode()
    return hmac.compare_digest(bearer, f"Bearer {key}".encode()) or hmac.compare_digest(api_key, key.encode())


async def until_disconnected(request: Request, handling: Awaitable[Response]) -> Response:
    """Run a route's ``handling`` until it returns or the client goes away, whichever comes first.

    uvicorn does not cancel a handler whose client left, so a non-streaming generate would decode to its
    end for nobody. Here a disconnect cancels ``handling``; the front's ``agenerate`` aborts whatever it
    submitted when cancelled. A stream is returned at once and aborts itself (``_sse``, ``_openai_sse``).
    The body must have been read: what ``request.receive`` yields after it is the disconnect.
    """
    work = asyncio.ensure_future(handling)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left (or this handler was cancelled): stop what it runs
            work.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    try:
        await work
    except asyncio.CancelledError:
        pass
    logger.info("%s %s: the client disconnected; its request was aborted", request.method, request.url.path)
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(request: Request, it: RequestStream, fill: Any = None) -> AsyncIterator[bytes]:
    try:
        async for item in it:
            if await request.is_disconnected():
                return
            if fill is not None:
                item = fill(item)
            yield b"data: " + orjson.dumps(item) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:  # the client left (or the response was cancelled): abort the request if it still runs
        await it.aclose()


