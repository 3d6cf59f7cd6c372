"""/v1/embeddings (OpenAI's shape) and /v1/rerank (vLLM's and Cohere's), over a ``Front`` of an
embedding server (--is-embedding).

Every input is one request of the scheduler that returns the prompt's pooled final hidden state
(runtime/model_executor/pooling.py); the inputs of a call run as one batch. A rerank embeds the query
and the documents in one call and scores each document by the cosine of its embedding and the query's
(a bi-encoder; a cross-encoder is not served). A generation server refuses both routes with a 400
naming the model. Errors are OpenAI's ``{"error": {..., "param"}}``.
"""
from __future__ import annotations

import base64
import math
import struct
import uuid
from typing import Any, Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from radixlang.runtime.entrypoints.http_common import Front, json_object, model_name, parse_model, unknown_model
from radixlang.runtime.errors import RequestError
from radixlang.runtime.io_struct import check_embedding_match
from radixlang.runtime.tokenizer_source import encode_prompt

MAX_INPUTS = 2048  # inputs per call, as OpenAI caps them: bounds the work one request can queue
_STRICT = ConfigDict(extra="forbid", strict=True)


class EmbeddingRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class RerankRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


def add_embedding_routes(app: FastAPI, engine: Front) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await serve_embeddings(engine, json_object(await request.body()))

    @app.post("/v1/rerank")
    @app.post("/rerank")
    async def rerank(request: Request) -> Response:
        return await serve_rerank(engine, json_object(await request.body()))


async def serve_embeddings(engine: Front, body: dict[str, Any]) -> Response:
    req = parse_model(EmbeddingRequest, body)
    if (missing := unknown_model(engine, req.model)) is not None:
        return missing
    vectors, prompt_tokens = await embed(engine, _input_ids(engine, req.input), dimensions=req.dimensions)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return _json({"object": "list", "data": data, "model": model_name(engine),
                  "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


async def serve_rerank(engine: Front, body: dict[str, Any]) -> Response:
    req = parse_model(RerankRequest, body)
    if (missing := unknown_model(engine, req.model)) is not None:
        return missing
    if not req.query:
        raise RequestError("query must not be empty", "query")
    if len(req.documents) + 1 > MAX_INPUTS:
        raise RequestError(f"documents takes at most {MAX_INPUTS - 1} entries, got {len(req.documents)}",
                           "documents")
    if (empty := next((i for i, d in enumerate(req.documents) if not d), None)) is not None:
        raise RequestError(f"documents[{empty}] is empty", "documents")
    ids = [encode_prompt(engine.tokenizer, text) for text in [req.query, *req.documents]]
    vectors, prompt_tokens = await embed(engine, ids, dimensions=None)
    query, docs = vectors[0], vectors[1:]
    ranked = sorted(range(len(docs)), key=lambda i: -_cosine(query, docs[i]))[:req.top_n]
    results = [{"index": i, "relevance_score": _cosine(query, docs[i]),
                **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in ranked]
    return _json({"id": f"rerank-{uuid.uuid4().hex}", "model": model_name(engine), "results": results,
                  "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


async def embed(engine: Front, ids: list[list[int]], *, dimensions: int | None) -> tuple[list[list[float]], int]:
    """The embedding of each prompt (in order) and the prompts' tokens together."""
    check_embedding_match(embedding=True, is_embedding=engine.server_args.is_embedding,
                          model=model_name(engine))
    outs = await engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, embedding=True,
                                 embedding_dimensions=dimensions)
    outs = outs if isinstance(outs, list) else [outs]
    for out in outs:
        reason = out["meta_info"].get("finish_reason") or {}
        if reason.get("type") == "abort":
            if not reason.get("status_code"):
                raise RuntimeError(f"an embedding request failed: {reason.get('message')}")
            param = reason.get("param")
            raise RequestError(reason.get("message", "request refused"), "input" if param == "input_ids" else param)
    return [out["embedding"] for out in outs], sum(out["meta_info"]["prompt_tokens"] for out in outs)


def _input_ids(engine: Front, given: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """Each input's token ids: a text tokenized as generation tokenizes a prompt, ids as they came."""
    items: list[Any] = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)
    if not items:
        raise RequestError("input must not be empty", "input")
    if len(items) > MAX_INPUTS:
        raise RequestError(f"input takes at most {MAX_INPUTS} entries, got {len(items)}", "input")
    ids = [encode_prompt(engine.tokenizer, x) if isinstance(x, str) else list(x) for x in items]
    if (empty := next((i for i, x in enumerate(ids) if not x), None)) is not None:
        raise RequestError(f"input[{empty}] is empty: every input needs at least one token", "input")
    return ids


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: its little-endian float32 bytes, as OpenAI sends them."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _cosine(a: list[float], b: list[float]) -> float:
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b)) / norm if norm else 0.0


def _json(payload: dict[str, Any]) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")
