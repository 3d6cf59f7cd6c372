"""OpenAI serving: /v1/completions and /v1/chat/completions over a ``Front``, whole or streamed."""
from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import Callable
from typing import Any, AsyncIterator, NamedTuple

import orjson
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlang.runtime.entrypoints.http_common import (
    Front, chat_template_of, check_outputs, lora_of_model, model_name, parse_model, unknown_model,
)
from radixlang.runtime.entrypoints.openai.chat_output import ChatOutput, keep_special_markers, special_tokens
from radixlang.runtime.entrypoints.openai.reasoning_parser import make_reasoning_parser
from radixlang.runtime.entrypoints.openai.protocol import (
    ChatRequest, CompletionRequest, Tool, active_tools, chat_constraint, chat_logprobs, chat_prompt,
    completion_logprobs, echo_logprobs, envelope, finish_reason, to_sampling, usage,
)
from radixlang.runtime.entrypoints.openai.tool_constraint import (
    answer_constraint, answers_in_format, auto_call_constraint, holds_auto_calls,
)
from radixlang.runtime.errors import RequestError
from radixlang.runtime.front.tokenizer_manager import RequestStream
from radixlang.runtime.tokenizer_source import BUILTIN_TEMPLATES, encode_chat

_MAX_CHOICES = 1024  # prompts x n per HTTP call: bounds the work one request can queue
_OPENAI_NAMES = {"sampling_seed": "seed", "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                 "input_ids": "prompt", "text": "prompt"}
_RENAMED_PARAMS = ("sampling_seed", "max_new_tokens", "min_new_tokens")  # messages that open with one say its name


async def serve_completions(engine: Front, body: dict[str, Any]) -> Response:
    req = parse_model(CompletionRequest, body)
    if (missing := unknown_model(engine, req.model, adapters=True)) is not None:
        return missing
    if req.suffix is not None:
        raise RequestError("suffix is not supported", "suffix")
    prompts = _completion_prompts(req.prompt)
    return await _serve_openai(engine, req, prompts, to_sampling(req, None), chat=False, tools=[],
                               top_logprobs=req.logprobs, echo=req.echo)


async def serve_chat(engine: Front, body: dict[str, Any]) -> Response:
    req = parse_model(ChatRequest, body)
    if (missing := unknown_model(engine, req.model, adapters=True)) is not None:
        return missing
    chat = prepare_chat(engine, req)
    return await _serve_openai(engine, req, [chat.ids], chat.params, chat=True, tools=chat.tools,
                               top_logprobs=chat.top_logprobs, drop=chat.drop,
                               grammar_field=_grammar_field(req, chat.tools))


class PreparedChat(NamedTuple):
    """A chat request made ready to run: what the chat route submits (the Anthropic route and /tokenize
    reuse it, so every route renders and tokenizes a conversation the same way)."""
    prompt: str  # the rendered template
    ids: list[int]  # the prompt's token ids
    params: dict[str, Any]  # sampling params for one choice
    tools: list[Tool]  # the tools in play (none under tool_choice "none")
    top_logprobs: int | None
    drop: tuple[str, ...]  # special tokens to drop from the text before parsing
    output: Callable[[], ChatOutput]  # a fresh parser for one choice's text (reasoning, then tool calls)


def prepare_chat(engine: Front, req: ChatRequest, *, add_generation_prompt: bool = True) -> PreparedChat:
    """Check, render and tokenize a chat request; its sampling params with the constraint it imposes."""
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    if req.store:
        raise RequestError("store=true is not supported: this server keeps no completions", "store")
    if not chat_template_of(engine):
        raise RequestError("this model has no chat template (a base model): start the server with --chat-template "
                           f"naming a file or a built-in template ({', '.join(BUILTIN_TEMPLATES)}), or send the "
                           "text to /v1/completions", "messages")
    tools = active_tools(req)
    constraint = chat_constraint(req, tools)
    probe = _chat_output(engine, req, tools, drop=())
    if _forced(req, tools):  # the calls in the parser's own format, arguments under each tool's schema
        tag = probe.forced_tag([(t.function.name, t.function.parameters) for t in tools])
        constraint = ("structural_tag", json.dumps(tag))
    elif constraint is not None and answers_in_format(req, tools):  # a call, or an answer in the format
        constraint = answer_constraint(probe, tools, constraint)
    prompt = chat_prompt(engine.tokenizer, req, tools, chat_template_of(engine) if engine.server_args.chat_template
                         else None, call_format=_call_format(req, tools, probe),
                         add_generation_prompt=add_generation_prompt)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = to_sampling(req, constraint)
    _constrain_after_reasoning(engine, req, params)
    args = engine.server_args
    if holds_auto_calls(req, tools, disabled=args.disable_tool_call_constraint):
        # free text until a call's trigger, so it never waits for the reasoning's end
        params["structural_tag"] = auto_call_constraint(
            probe, tools, tool_call_parser=args.tool_call_parser, chat_template=chat_template_of(engine),
            grammar_backend=args.grammar_backend, special=special_tokens(engine.tokenizer))
    keep, drop = keep_special_markers(probe, engine.tokenizer)
    if keep and req.skip_special_tokens is None:  # the format's markers are special tokens: decode them
        params["skip_special_tokens"] = False
    else:
        drop = ()
    # the template wrote the special tokens (a BOS too): tokenized as apply_chat_template(tokenize=True) does
    ids = encode_chat(engine.tokenizer, prompt)
    return PreparedChat(prompt=prompt, ids=ids, params=params, tools=tools, top_logprobs=top, drop=drop,
                        output=functools.partial(_chat_output, engine, req, tools, drop=drop))


_GRAMMAR_PARAMS = ("regex", "json_schema", "ebnf", "structural_tag")


def _constrain_after_reasoning(engine: Front, req: ChatRequest, params: dict[str, Any]) -> None:
    """With --reasoning-parser, a constraint (response_format, a forced tool call, regex ...) applies
    only after the reasoning ends, free text before it (as SGLang's reasoning-aware grammars do)."""
    name = engine.server_args.reasoning_parser
    given = [p for p in _GRAMMAR_PARAMS if p in params]
    if not name or not given:
        return
    parser = make_reasoning_parser(name)
    if not parser.thinks(req.chat_template_kwargs):
        return
    if parser.reasoning_end is None:
        field = "tool_choice" if given[0] == "structural_tag" and req.response_format is None else (
            "response_format" if req.response_format is not None else given[0])
        raise RequestError(f"a grammar constraint cannot be combined with --reasoning-parser {name}: its reasoning "
                           "has no end marker a grammar can wait for", field)
    params["constrain_after"] = parser.reasoning_end


def _chat_output(engine: Front, req: ChatRequest, tools: list[Tool], *, drop: tuple[str, ...]) -> ChatOutput:
    args = engine.server_args
    return ChatOutput(tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                      chat_template=chat_template_of(engine), tool_names={t.function.name for t in tools},
                      forced=_forced(req, tools), parallel=_parallel(req, tools),
                      separate_reasoning=req.separate_reasoning, drop=drop,
                      answer_format=answers_in_format(req, tools))


def _parallel(req: ChatRequest, tools: list[Tool]) -> bool:
    """Whether a reply may hold several calls: a forced tool_choice answers with one call unless the
    request asks for parallel calls (a model left to repeat itself would make the same call again)."""
    if _forced(req, tools) or answers_in_format(req, tools):
        return req.parallel_tool_calls is True
    return req.parallel_tool_calls is not False


def _grammar_field(req: Any, tools: list[Tool]) -> str | None:
    """The chat request field a refused grammar came from, when the server built it (a response_format
    schema, a forced call's tools); None: the caller's own regex / json_schema / ebnf, named as they are."""
    if _forced(req, tools) or holds_auto_calls(req, tools, disabled=False):
        return "tools"
    fmt = getattr(req, "response_format", None)
    return "response_format" if fmt is not None and fmt.type != "text" else None


def _call_format(req: ChatRequest, tools: list[Tool], probe: ChatOutput) -> str:
    return probe.tools.example if probe.tools is not None else ""


def _forced(req: Any, tools: list[Tool]) -> bool:
    return bool(tools) and isinstance(req, ChatRequest) and req.tool_choice not in (None, "auto")


def _completion_prompts(prompt: Any) -> list[str] | list[list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def _serve_openai(engine: Front, req: Any, prompts: list, params: dict[str, Any], *,
                        chat: bool, tools: list[Tool], top_logprobs: int | None, echo: bool = False,
                        drop: tuple[str, ...] = (), grammar_field: str | None = None) -> Response:
    try:
        return await _run_openai(engine, req, prompts, params, chat=chat, tools=tools, top_logprobs=top_logprobs,
                                 echo=echo, drop=drop)
    except RequestError as e:  # report the field by its OpenAI name
        param = e.param
        if grammar_field is not None and param in (*_GRAMMAR_PARAMS, "constrain_after"):
            param = grammar_field
        fallback = "messages" if chat and param in ("prompt", None) else param
        name = _OPENAI_NAMES.get(param or "", fallback)
        message = str(e)
        if param in _RENAMED_PARAMS and name and message.startswith(param + " "):  # "max_tokens is too large"
            message = name + message[len(param):]
        raise RequestError(message, name) from None


async def _run_openai(engine: Front, req: Any, prompts: list, params: dict[str, Any], *,
                      chat: bool, tools: list[Tool], top_logprobs: int | None, echo: bool,
                      drop: tuple[str, ...]) -> Response:
    if len(prompts) * req.n > _MAX_CHOICES:
        raise RequestError(f"prompts x n must be <= {_MAX_CHOICES}, got {len(prompts) * req.n}", "n")
    key = "input_ids" if prompts and not isinstance(prompts[0], str) else "prompt"
    lp = {"return_logprob": top_logprobs is not None, "top_logprobs_num": top_logprobs or 0,
          "lora_path": lora_of_model(engine, req.model)}
    if echo and top_logprobs is not None:
        lp["logprob_start_len"] = 0  # the prompt's logprobs come first, as OpenAI's echo gives them
    ctx = _Ctx(engine=engine, model=req.model if lp["lora_path"] else model_name(engine), chat=chat, tools=tools,
               forced=_forced(req, tools), logprobs=top_logprobs is not None,
               rid=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", req=req,
               echo_texts=_echo_texts(engine, prompts, req.n) if echo else None, drop=drop)
    param = "messages" if chat else "prompt"
    if not req.stream:
        outs = await engine.generate(**{key: prompts}, sampling_params={**params, "n": req.n}, **lp)
        check_outputs(outs, param)
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


def _echo_texts(engine: Front, prompts: list, n: int) -> list[str]:
    """The prompt text of each choice (choices are prompts x n, in order)."""
    texts = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts]
    return [t for t in texts for _ in range(n)]


class _Ctx:
    """What building one OpenAI response (or its chunks) needs."""

    def __init__(self, *, engine: Front, model: str, chat: bool, tools: list[Tool], forced: bool, logprobs: bool,
                 rid: str, req: Any, echo_texts: list[str] | None = None, drop: tuple[str, ...] = ()) -> None:
        self.engine, self.model, self.chat, self.tools, self.forced = engine, model, chat, tools, forced
        self.logprobs, self.rid, self.echo_texts = logprobs, rid, echo_texts
        self.outputs: dict[int, ChatOutput] = {}
        self.req, self.drop = req, drop

    def output(self, index: int) -> ChatOutput:
        """The parsers of choice ``index`` (made on first use: a stream keeps them across chunks)."""
        if index not in self.outputs:
            self.outputs[index] = _chat_output(self.engine, self.req, self.tools, drop=self.drop)
        return self.outputs[index]

    def choice(self, index: int, out: dict[str, Any]) -> dict[str, Any]:
        tok = self.engine.tokenizer
        choice: dict[str, Any] = {"index": index}
        reason = out["meta_info"].get("finish_reason") or {}
        if self.chat:
            parsed = self.output(index)
            choice["message"] = parsed.message(out["text"])
            choice["logprobs"] = chat_logprobs(tok, out) if self.logprobs else None
            choice["finish_reason"] = finish_reason(out, tool_calls=parsed.has_calls)
        else:
            echo = self.echo_texts[index] if self.echo_texts is not None else ""
            choice["text"] = echo + out["text"]
            choice["logprobs"] = None
            if self.logprobs:
                choice["logprobs"] = completion_logprobs(tok, out, offset=len(echo))
                if self.echo_texts is not None:
                    choice["logprobs"] = echo_logprobs(tok, out, choice["logprobs"])
            choice["finish_reason"] = finish_reason(out)
        choice["matched_stop"] = reason.get("matched")
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
            parsed = self.output(index)
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            delta.update(parsed.delta(text, final=done))
            choice["delta"] = delta
            choice["logprobs"] = chat_logprobs(tok, out, sent_tokens) if self.logprobs else None
        else:
            echo = self.echo_texts[index] if self.echo_texts is not None and first else ""
            offset = sent_text + (len(self.echo_texts[index]) if self.echo_texts is not None else 0)
            choice["text"] = echo + text
            choice["logprobs"] = None
            if self.logprobs:
                choice["logprobs"] = completion_logprobs(tok, out, sent_tokens, offset)
                if echo:
                    choice["logprobs"] = echo_logprobs(tok, out, choice["logprobs"])
        if done:
            choice["finish_reason"] = finish_reason(out, tool_calls=bool(self.chat and self.output(index).has_calls))
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
                                                              "type": "invalid_request_error",
                                                              "param": _stream_error_param(ctx, reason),
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


def _stream_error_param(ctx: _Ctx, reason: dict[str, Any]) -> str | None:
    """The request field a refusal met mid-stream names (a grammar: the field it came from)."""
    param = reason.get("param")
    field = _grammar_field(ctx.req, ctx.tools) if ctx.chat else None
    return field if field is not None and param in (*_GRAMMAR_PARAMS, "constrain_after") else param


async def _pump(index: int, it: RequestStream, queue: asyncio.Queue) -> None:
    async for item in it:
        await queue.put((index, item))
