"""OpenAI request/response adapters (the subset served so far)."""
from __future__ import annotations

import time
import uuid
from typing import Any

_PASSTHROUGH = {"temperature": "temperature", "top_p": "top_p", "stop": "stop", "seed": "sampling_seed",
                "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                "top_k": "top_k", "min_p": "min_p", "regex": "regex", "ignore_eos": "ignore_eos"}


def openai_sampling(body: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    for src, dst in _PASSTHROUGH.items():
        if body.get(src) is not None:
            params[dst] = body[src]
    n = body.get("n", 1)
    if n != 1:
        params["n"] = n
    if body.get("stream"):
        raise ValueError("stream=true is not supported on the OpenAI routes yet; use /generate with stream")
    return params


def chat_to_prompt(tokenizer: Any, messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool") \
                or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be {{'role': system|user|assistant|tool, 'content': str}}")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def completion_response(outs: list[dict[str, Any]], *, model: str, chat: bool) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outs):
        reason = out["meta_info"]["finish_reason"] or {}
        finish = "length" if reason.get("type") == "length" else "stop"
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": out["text"]},
                            "finish_reason": finish})
        else:
            choices.append({"index": i, "text": out["text"], "finish_reason": finish})
    prompt_tokens = outs[0]["meta_info"]["prompt_tokens"]
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"id": uuid.uuid4().hex, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion,
                      "prompt_tokens_details": {"cached_tokens": outs[0]["meta_info"]["cached_tokens"]}}}
