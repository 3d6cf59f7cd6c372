"""/tokenize, /detokenize and /tokenizer_info in vLLM's shapes, over a ``Front``.

What lm-eval-harness's remote tokenizer (``tokenizer_backend=remote`` of local-completions) reads:
``/tokenizer_info``'s ``eos_token`` / ``bos_token`` / ``pad_token`` / ``chat_template``, ``/tokenize``
with ``{"prompt", "add_special_tokens": false}`` -> ``tokens``, ``/detokenize`` ``{"tokens"}`` ->
``prompt``. A prompt is tokenized exactly as generation tokenizes it: a text as ``encode_prompt`` does
(with ``add_special_tokens``, the default), messages by the chat route's own ``prepare_chat``.
Errors are the native / OpenAI ``{"error": {..., "param"}}`` 400s.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from radixlang.runtime.entrypoints.http_common import Front, chat_template_of, json_object, parse_model
from radixlang.runtime.entrypoints.openai.protocol import ChatRequest
from radixlang.runtime.entrypoints.openai.serving import prepare_chat
from radixlang.runtime.errors import RequestError
from radixlang.runtime.tokenizer_source import encode_chat, encode_prompt

_STRICT = ConfigDict(extra="forbid", strict=True)
# tokenizer config entries /tokenizer_info leaves out: file paths of this machine, and the (large) added-token table
_PRIVATE = frozenset({"added_tokens_decoder", "name_or_path", "vocab_file", "merges_file", "tokenizer_file",
                      "is_local", "local_files_only"})


class TokenizePrompt(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    model_config = _STRICT
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes its special tokens
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class Detokenize(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, engine: Front) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        ids, strs = tokenize_body(engine, json_object(await request.body()))
        info = await engine.get_server_info()
        return {"count": len(ids), "max_model_len": info.get("context_length"), "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_model(Detokenize, json_object(await request.body()))
        vocab = len(engine.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"tokens must be ids in [0, {vocab}), got {bad[0]}", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return tokenizer_info_of(engine)


def tokenize_body(engine: Front, body: dict[str, Any]) -> tuple[list[int], list[str] | None]:
    """The ids of a /tokenize body (a prompt, or messages), and their token strings when asked for."""
    tok = engine.tokenizer
    if "messages" in body:
        chat = parse_model(TokenizeChat, body)
        req = parse_model(ChatRequest, {"messages": chat.messages, **({"tools": chat.tools} if chat.tools else {}),
                                        **({"chat_template_kwargs": chat.chat_template_kwargs}
                                           if chat.chat_template_kwargs is not None else {})})
        prepared = prepare_chat(engine, req, add_generation_prompt=chat.add_generation_prompt)
        ids = encode_prompt(tok, prepared.prompt) if chat.add_special_tokens else encode_chat(tok, prepared.prompt)
        strs = chat.return_token_strs
    else:
        req_p = parse_model(TokenizePrompt, body)
        ids = encode_prompt(tok, req_p.prompt) if req_p.add_special_tokens else list(
            tok.encode(req_p.prompt, add_special_tokens=False))
        strs = req_p.return_token_strs
    return ids, (list(tok.convert_ids_to_tokens(ids)) if strs else None)


def tokenizer_info_of(engine: Front) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's class and config, special tokens as strings, the chat template
    in use (--chat-template's, else the tokenizer's)."""
    tok = engine.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    for key, value in (getattr(tok, "init_kwargs", None) or {}).items():
        if key not in _PRIVATE and (value := _plain(value)) is not None:
            info[key] = value
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tok, name, None)
        info[name] = str(value) if value is not None else None
    info["chat_template"] = chat_template_of(engine)
    info["vocab_size"] = len(tok)
    return info


def _plain(value: Any) -> Any:
    """``value`` as JSON (an AddedToken as its text); None when it is no JSON value."""
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
        return None  # transformers' "no limit" model_max_length (1e30): no JSON integer a client reads
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "content") and isinstance(value.content, str):  # tokenizers.AddedToken
        return value.content
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return items if all(v is not None for v in items) else None
    if isinstance(value, dict):
        out = {str(k): _plain(v) for k, v in value.items()}
        return out if all(v is not None for v in out.values()) else None
    return None
