"""FastAPI app: SGLang-native routes and the OpenAI-compatible subset, over an in-process Engine.

The app holds one Engine (its scheduler runs on a background thread). Blocking
engine calls run in worker threads so the event loop keeps serving.
"""
from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlang.runtime.engine import Engine
from radixlang.runtime.openai_api import chat_to_prompt, completion_response, openai_sampling


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": status}}, status_code=status)


def create_app(engine: Engine) -> FastAPI:
    args = engine.server_args
    app = FastAPI(title="radixlang")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if args.api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {args.api_key}".encode()):
                return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > args.max_request_body_bytes:
            return _error(413, f"request body over {args.max_request_body_bytes} bytes")
        return await call_next(request)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            raise ValueError(f"the body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

    @app.exception_handler(ValueError)
    async def value_error(_: Request, exc: ValueError) -> JSONResponse:
        return _error(400, str(exc))

    @app.get("/health")
    async def health() -> Response:
        if engine._error is not None or not engine._thread.is_alive():
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        out = await asyncio.to_thread(engine.generate, input_ids=[1], sampling_params={"max_new_tokens": 1})
        return Response(status_code=200 if out["meta_info"]["finish_reason"]["type"] != "abort" else 503)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": engine.scheduler.runner.model_path, "tokenizer_path": engine.scheduler.runner.tokenizer_path,
                "is_generation": True, "chat_template": getattr(engine.tokenizer, "chat_template", None)}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return await asyncio.to_thread(engine.get_server_info)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = await asyncio.to_thread(engine.flush_cache)
        if not ok:
            return _error(400, "cannot flush the cache while requests are running")
        return JSONResponse({"success": True, "message": "cache flushed"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise ValueError("rid must be a string")
        await asyncio.to_thread(engine.abort_request, rid)
        return {"success": True}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await body_of(request)
        known = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                 "return_text_in_logprobs", "stream", "rid"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"unknown field(s): {', '.join(unknown)}")
        kw = {"prompt": body.get("text"), "input_ids": body.get("input_ids"),
              "sampling_params": body.get("sampling_params"), "return_logprob": bool(body.get("return_logprob", False)),
              "logprob_start_len": body.get("logprob_start_len"), "top_logprobs_num": int(body.get("top_logprobs_num") or 0),
              "rid": body.get("rid")}
        if body.get("stream"):
            it = engine.generate(**kw, stream=True)
            return StreamingResponse(_sse(request, engine, it), media_type="text/event-stream")
        out = await asyncio.to_thread(engine.generate, **kw)
        return Response(orjson.dumps(out), media_type="application/json")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = args.served_model_name or engine.scheduler.runner.model_path
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "radixlang"}]}

    async def _openai(request: Request, chat: bool) -> Response:
        body = await body_of(request)
        if chat:
            prompt = chat_to_prompt(engine.tokenizer, body.get("messages"))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
        params = openai_sampling(body)
        model = body.get("model") or args.served_model_name or engine.scheduler.runner.model_path
        outs = await asyncio.to_thread(engine.generate, [prompt], [params])
        return JSONResponse(completion_response(outs, model=model, chat=chat))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _openai(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _openai(request, chat=True)

    return app


async def _sse(request: Request, engine: Engine, it) -> AsyncIterator[bytes]:
    sentinel = object()
    rid = None
    try:
        while True:
            item = await asyncio.to_thread(next, it, sentinel)
            if item is sentinel:
                break
            rid = item["meta_info"]["id"]
            if await request.is_disconnected():
                await asyncio.to_thread(engine.abort_request, rid)
                return
            yield b"data: " + orjson.dumps(item) + b"\n\n"
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:
        if rid is not None:
            engine.abort_request(rid)
        raise
