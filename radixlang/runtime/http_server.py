"""FastAPI app: SGLang-native routes and the OpenAI-compatible subset, over a ``Front``.

The app serves whatever implements ``Front``: in the server that is the
TokenizerManager, which talks to the scheduler and detokenizer processes over ZMQ.
Every front call is a coroutine, so the event loop keeps serving while requests run.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import uuid
from typing import Any, AsyncIterator, Protocol

import orjson
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlang.runtime.config import ServerArgs
from radixlang.runtime.metrics import make_registry, render
from radixlang.runtime.sampling_params import SamplingParams
from radixlang.runtime.tokenizer_manager import RequestStream
from radixlang.runtime.openai_api import (
    ChatRequest, CompletionRequest, FieldError, Tool, active_tools, chat_constraint, chat_logprobs, chat_prompt,
    completion_logprobs, envelope, finish_reason, parse_tool_calls, to_sampling, usage,
)

logger = logging.getLogger(__name__)
_MAX_CHOICES = 1024  # prompts x n per HTTP call: bounds the work one request can queue


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": status}}, status_code=status)


class Front(Protocol):
    """What the app needs from the runtime behind it (the TokenizerManager implements it)."""
    server_args: ServerArgs
    tokenizer: Any
    model_path: str
    tokenizer_path: str
    draining: bool  # shutting down: new requests get 503

    def is_healthy(self) -> bool: ...

    async def generate(self, **kwargs: Any) -> dict | list[dict]: ...

    async def stream(self, **kwargs: Any) -> RequestStream:
        """Submit now (a bad request raises here); iterate for snapshots; ``aclose()`` aborts if unfinished."""

    def abort_request(self, rid: str) -> None: ...

    async def flush_cache(self) -> bool: ...

    async def get_server_info(self) -> dict[str, Any]: ...


def create_app(engine: Front) -> FastAPI:
    args = engine.server_args
    app = FastAPI(title="radixlang")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if engine.draining:
            return _error(503, "the server is shutting down")
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
        return _error(400, str(exc), getattr(exc, "param", None) or _named_field(str(exc)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
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
        out = await engine.generate(input_ids=[1], sampling_params={"max_new_tokens": 1})
        return Response(status_code=200 if out["meta_info"]["finish_reason"]["type"] != "abort" else 503)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path,
                "is_generation": True, "chat_template": getattr(engine.tokenizer, "chat_template", None)}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return await engine.get_server_info()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = await engine.flush_cache()
        if not ok:
            return _error(400, "cannot flush the cache while requests are running")
        return JSONResponse({"success": True, "message": "cache flushed"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise ValueError("rid must be a string")
        engine.abort_request(rid)
        return {"success": True}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req = _parse(GenerateRequest, await body_of(request))
        kw = {"prompt": req.text, "input_ids": req.input_ids, "sampling_params": req.sampling_params,
              "return_logprob": req.return_logprob, "logprob_start_len": req.logprob_start_len,
              "top_logprobs_num": req.top_logprobs_num, "rid": req.rid}
        if req.stream:
            it = await engine.stream(**kw)
            return StreamingResponse(_sse(request, it), media_type="text/event-stream")
        out = await engine.generate(**kw)
        _check_outputs(out if isinstance(out, list) else [out], "text" if req.text is not None else "input_ids")
        return Response(orjson.dumps(out), media_type="application/json")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": _model_name(engine), "object": "model", "owned_by": "radixlang"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = _parse(CompletionRequest, await body_of(request))
        if req.echo and req.logprobs is not None:
            raise FieldError("echo with logprobs is not supported", "echo")
        if req.suffix is not None:
            raise FieldError("suffix is not supported", "suffix")
        prompts = _completion_prompts(req.prompt)
        return await _serve_openai(engine, req, prompts, to_sampling(req, None), chat=False, tools=[],
                                   top_logprobs=req.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = _parse(ChatRequest, await body_of(request))
        if req.top_logprobs is not None and not req.logprobs:
            raise FieldError("top_logprobs needs logprobs=true", "top_logprobs")
        tools = active_tools(req)
        constraint = chat_constraint(req, tools)
        prompt = chat_prompt(engine.tokenizer, req, tools)
        top = (req.top_logprobs or 0) if req.logprobs else None
        return await _serve_openai(engine, req, [prompt], to_sampling(req, constraint), chat=True,
                                   tools=tools, top_logprobs=top)

    return app


async def _sse(request: Request, it: RequestStream) -> AsyncIterator[bytes]:
    try:
        async for item in it:
            if await request.is_disconnected():
                return
            yield b"data: " + orjson.dumps(item) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:  # the client left (or the response was cancelled): abort the request if it still runs
        await it.aclose()


class GenerateRequest(pydantic.BaseModel):
    """SGLang's native /generate body; sampling_params are checked by SamplingParams itself."""
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = pydantic.Field(default=None, ge=-1)
    top_logprobs_num: int = pydantic.Field(default=0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | None = None


def _model_name(engine: Front) -> str:
    return engine.server_args.served_model_name or engine.model_path


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | frozenset(GenerateRequest.model_fields)
_OPENAI_NAMES = {"sampling_seed": "seed", "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                 "input_ids": "prompt", "text": "prompt"}


def _named_field(message: str) -> str | None:
    """The first request field a validation message mentions ("top_p must be ..."), reported as the param."""
    for word in message.replace(",", " ").replace(":", " ").split():
        if word in _FIELDS:
            return word
    return None


def _parse(model: type[pydantic.BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        raise FieldError(f"{where}: {err['msg']}", str(err["loc"][0]) if err["loc"] else None) from None


def _completion_prompts(prompt: Any) -> list[str] | list[list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise FieldError("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _check_outputs(outs: list[dict[str, Any]], param: str) -> None:
    """A request the scheduler refused (bad length, token id, grammar) is the caller's error: 400."""
    for out in outs:
        reason = out["meta_info"].get("finish_reason") or {}
        if reason.get("type") == "abort" and reason.get("status_code"):
            raise FieldError(reason.get("message", "request refused"), _named_field(reason.get("message", "")) or param)


async def _serve_openai(engine: Front, req: Any, prompts: list, params: dict[str, Any], *,
                        chat: bool, tools: list[Tool], top_logprobs: int | None) -> Response:
    try:
        return await _run_openai(engine, req, prompts, params, chat=chat, tools=tools, top_logprobs=top_logprobs)
    except FieldError as e:
        fallback = "messages" if chat and e.param in ("prompt", None) else e.param
        raise FieldError(str(e), _OPENAI_NAMES.get(e.param or "", fallback)) from None
    except ValueError as e:  # SamplingParams names its own fields; report them by their OpenAI names
        name = _named_field(str(e))
        raise FieldError(str(e), _OPENAI_NAMES.get(name or "", name)) from None


async def _run_openai(engine: Front, req: Any, prompts: list, params: dict[str, Any], *,
                      chat: bool, tools: list[Tool], top_logprobs: int | None) -> Response:
    if len(prompts) * req.n > _MAX_CHOICES:
        raise FieldError(f"prompts x n must be <= {_MAX_CHOICES}, got {len(prompts) * req.n}", "n")
    key = "input_ids" if prompts and not isinstance(prompts[0], str) else "prompt"
    lp = {"return_logprob": top_logprobs is not None, "top_logprobs_num": top_logprobs or 0}
    ctx = _Ctx(engine=engine, model=req.model or _model_name(engine), chat=chat, tools=tools,
               forced=bool(tools) and req.tool_choice not in (None, "auto") if chat else False,
               logprobs=top_logprobs is not None, rid=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}")
    param = "messages" if chat else "prompt"
    if not req.stream:
        outs = await engine.generate(**{key: prompts}, sampling_params={**params, "n": req.n}, **lp)
        _check_outputs(outs, param)
        groups = [outs[i * req.n:(i + 1) * req.n] for i in range(len(prompts))]
        return JSONResponse({**envelope(chat=chat, model=ctx.model, rid=ctx.rid, chunk=False),
                             "choices": [ctx.choice(i, o) for i, o in enumerate(outs)], "usage": usage(groups)})
    streams = []
    try:
        for p in prompts:
            for _ in range(req.n):
                streams.append(await engine.stream(**{key: p}, sampling_params={**params, "n": 1}, **lp))
    except BaseException:  # a later choice was refused: the earlier ones must not run on
        for it in streams:
            await it.aclose()
        raise
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(_openai_sse(engine, ctx, streams, req.n, include_usage=include_usage),
                             media_type="text/event-stream")


class _Ctx:
    """What building one OpenAI response (or its chunks) needs."""

    def __init__(self, *, engine: Front, model: str, chat: bool, tools: list[Tool], forced: bool, logprobs: bool,
                 rid: str) -> None:
        self.engine, self.model, self.chat, self.tools, self.forced = engine, model, chat, tools, forced
        self.logprobs, self.rid = logprobs, rid

    def choice(self, index: int, out: dict[str, Any]) -> dict[str, Any]:
        tok = self.engine.tokenizer
        calls = parse_tool_calls(out["text"], self.tools, forced=self.forced) if self.chat else None
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason(out, tool_calls=bool(calls))}
        reason = out["meta_info"].get("finish_reason") or {}
        choice["matched_stop"] = reason.get("matched")
        if self.chat:
            choice["message"] = {"role": "assistant", "content": None if calls else out["text"],
                                 **({"tool_calls": calls} if calls else {})}
            choice["logprobs"] = chat_logprobs(tok, out) if self.logprobs else None
        else:
            choice["text"] = out["text"]
            choice["logprobs"] = completion_logprobs(tok, out) if self.logprobs else None
        return choice

    def chunk(self, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> bytes:
        body = {**envelope(chat=self.chat, model=self.model, rid=self.rid, chunk=True), "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def delta(self, index: int, out: dict[str, Any], sent_text: int, sent_tokens: int, *,
              first: bool) -> dict[str, Any]:
        """The chunk choice for what `out` adds beyond sent_text characters and sent_tokens logprobs."""
        tok = self.engine.tokenizer
        text = out["text"][sent_text:]
        done = out["meta_info"].get("finish_reason") is not None
        choice: dict[str, Any] = {"index": index, "finish_reason": None}
        if self.chat:
            calls = parse_tool_calls(out["text"], self.tools, forced=self.forced) if done else None
            if self.tools:  # a tool call is only known at the end: the text was held back until now
                text = out["text"] if done and not calls else ""
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if calls:
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
            elif text:
                delta["content"] = text
            choice["delta"] = delta
            choice["logprobs"] = chat_logprobs(tok, out, sent_tokens) if self.logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = completion_logprobs(tok, out, sent_tokens, sent_text) if self.logprobs else None
        if done:
            choice["finish_reason"] = finish_reason(out, tool_calls=bool(self.chat and calls))
        return choice


async def _openai_sse(engine: Front, ctx: _Ctx, streams: list, n: int, *, include_usage: bool) -> AsyncIterator[bytes]:
    """Merge the choices' streams into OpenAI chunks; abort every unfinished choice if the client leaves."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, it, queue)) for i, it in enumerate(streams)]
    finals: dict[int, dict[str, Any]] = {}
    sent = [(0, 0)] * len(streams)
    started: set[int] = set()
    try:
        while len(finals) < len(streams):
            index, out = await queue.get()
            if out["meta_info"].get("finish_reason") is not None:
                reason = out["meta_info"]["finish_reason"]
                if reason.get("type") == "abort" and reason.get("status_code"):
                    yield b"data: " + orjson.dumps({"error": {"message": reason.get("message"),
                                                              "type": "invalid_request_error", "param": None,
                                                              "code": reason["status_code"]}}) + b"\n\n"
                finals[index] = out
            yield ctx.chunk([ctx.delta(index, out, *sent[index], first=index not in started)])
            started.add(index)
            sent[index] = (len(out["text"]), len(out["meta_info"].get("output_token_logprobs") or []))
        if include_usage:
            groups = [[finals[i * n + j] for j in range(n)] for i in range(len(streams) // n)]
            yield ctx.chunk([], usage(groups))
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        for it in streams:  # aborts every choice that has not finished
            await it.aclose()


async def _pump(index: int, it: RequestStream, queue: asyncio.Queue) -> None:
    async for item in it:
        await queue.put((index, item))
