"""What the native and the OpenAI routes share: the ``Front`` they serve, body parsing,
error responses, and turning a request the scheduler refused into a ``RequestError``."""
from __future__ import annotations

from typing import Any, Literal, Protocol

import orjson
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixlang.runtime.errors import RequestError
from radixlang.runtime.front.tokenizer_manager import RequestStream
from radixlang.runtime.server_args import ServerArgs
from radixlang.runtime.tokenizer_source import resolve_chat_template


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": status}}, status_code=status)


class Front(Protocol):
    """What the app needs from the runtime behind it (the TokenizerManager implements it)."""
    server_args: ServerArgs
    tokenizer: Any
    model_path: str
    tokenizer_path: str
    sampling_defaults: dict[str, Any]  # the model's, for a request's unset sampling fields
    draining: bool  # shutting down: new requests get 503

    def is_healthy(self) -> bool: ...

    async def generate(self, **kwargs: Any) -> dict | list[dict]: ...

    async def stream(self, **kwargs: Any) -> RequestStream:
        """Submit now (a bad request raises here); iterate for snapshots; ``aclose()`` aborts if unfinished."""

    def abort_request(self, rid: str) -> None: ...

    async def flush_cache(self) -> bool: ...

    async def get_server_info(self) -> dict[str, Any]: ...

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters served: name -> folder."""

    async def update_lora(self, name: str, path: str | None) -> tuple[bool, str]:
        """Load (``path`` given) or unload a LoRA adapter everywhere: (success, message)."""


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
    lora_path: str | None = None  # the name of a served LoRA adapter (SGLang's field); None: the base model
    # what SGLang's gateway (SMG) writes into every /generate it forwards: the model it routed by (this server
    # serves one), logging hints, and options at their "off" value; turning one of those on is a 400
    model: str | None = None
    log_metrics: bool = True
    no_logs: bool = False
    background: Literal[False] = False
    return_bytes: Literal[False] = False
    return_entropy: Literal[False] = False


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body: one JSON object, else a RequestError saying what came."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


def chat_template_of(engine: Front) -> str | None:
    """The chat template in use: --chat-template's (a built-in name or a file), else the tokenizer's."""
    name = engine.server_args.chat_template
    if name is not None:
        return resolve_chat_template(name)
    return getattr(engine.tokenizer, "chat_template", None)


DEFAULT_MODEL_ID = "default"  # accepted as well as the served id, as SGLang and the README's examples send it


def model_name(engine: Front) -> str:
    """The id the API serves the model as: --served-model-name, by default the model's own name
    (``ServerArgs.resolve`` fills it in)."""
    return engine.server_args.served_model_name or DEFAULT_MODEL_ID


def lora_of_model(engine: Front, model: str | None) -> str | None:
    """The LoRA adapter an OpenAI ``model`` names: an adapter's name, or ``<served id>:<adapter>``; None for
    the base model (or a model not served: see ``unknown_model``)."""
    if model is None:
        return None
    adapters = engine.lora_adapters
    if model in adapters:
        return model
    base, sep, name = model.rpartition(":")  # adapter names hold no ':'
    if sep and base in (model_name(engine), DEFAULT_MODEL_ID) and name in adapters:
        return name
    return None


def unknown_model(engine: Front, model: str | None, *, adapters: bool = False) -> JSONResponse | None:
    """OpenAI's 404 for a model this server does not serve; None when ``model`` is its id, "default",
    absent, or (``adapters``: a route that runs LoRA adapters) names a served adapter."""
    served = model_name(engine)
    if model is None or model in (served, DEFAULT_MODEL_ID):
        return None
    if adapters and lora_of_model(engine, model) is not None:
        return None
    also = ""
    if engine.lora_adapters:
        also = (f"; LoRA adapters: {', '.join(f'`{n}`' for n in sorted(engine.lora_adapters))}"
                + ("" if adapters else " (not on this route)"))
    return JSONResponse({"error": {"message": f"The model `{model}` does not exist: this server serves "
                                              f"`{served}` (or send `{DEFAULT_MODEL_ID}`){also}",
                                   "type": "invalid_request_error", "param": "model", "code": "model_not_found"}},
                        status_code=404)


def install_error_handlers(app: FastAPI) -> None:
    """Answer routing errors (404 no such route, 405 wrong method) in the API's error shape, not FastAPI's
    ``{"detail": ...}``; a 405 keeps its Allow header."""

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = f"no route {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        response = error_response(exc.status_code, message)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response


def parse_model(model: type[pydantic.BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        raise RequestError(f"{where}: {err['msg']}", str(err["loc"][0]) if err["loc"] else None) from None


def check_outputs(outs: list[dict[str, Any]], param: str) -> None:
    """A request the scheduler refused (bad length, token id, grammar) is the caller's error: 400."""
    for out in outs:
        reason = out["meta_info"].get("finish_reason") or {}
        if reason.get("type") == "abort" and reason.get("status_code"):
            message = reason.get("message", "request refused")
            raise RequestError(message, reason.get("param") or param)


_LOGPROB_LISTS = ("input_token_logprobs", "output_token_logprobs")
_TOP_LOGPROB_LISTS = ("input_top_logprobs", "output_top_logprobs")


def fill_logprob_text(tokenizer: Any, out: dict[str, Any]) -> dict[str, Any]:
    """return_text_in_logprobs: every (logprob, token_id, None) entry gets its token's text, as SGLang's
    tokenizer manager does (each id decoded alone, special tokens kept). Modifies and returns ``out``."""
    meta = out["meta_info"]
    cache: dict[int, str] = {}

    def entry(e: Any) -> list[Any]:
        tid = e[1]
        if tid not in cache:
            cache[tid] = tokenizer.decode([tid])
        return [e[0], tid, cache[tid]]

    for key in _LOGPROB_LISTS:
        if meta.get(key) is not None:
            meta[key] = [entry(e) for e in meta[key]]
    for key in _TOP_LOGPROB_LISTS:
        if meta.get(key) is not None:
            meta[key] = [None if row is None else [entry(e) for e in row] for row in meta[key]]
    return out


