"""OpenAI: any OpenAI-compatible server (completions or chat) over httpx.

select is a constrained generation: the choices become a regex sent as the
SGLang-compatible extra field ``regex`` (radixlang, SGLang and vLLM accept
it). A server that ignores it and answers something else is a clear error.
"""
from __future__ import annotations

import os
import re
from typing import Any, Sequence

import orjson

from radixlang.lang.backends.base import Backend, GenParams, check_choices
from radixlang.lang.chat_template import ChatTemplate, get_chat_template
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod

# wire sampling name -> OpenAI body name (the rest are SGLang-compatible extras, sent as they are)
_TO_OPENAI = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "stop": "stop",
              "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
              "top_k": "top_k", "min_p": "min_p", "ignore_eos": "ignore_eos", "regex": "regex"}


class OpenAI(Backend):
    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None, *,
                 is_chat_model: bool = True, chat_template: ChatTemplate | None = None,
                 timeout: float = 600.0, transport: Any = None) -> None:
        import httpx
        self.model = model
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1").rstrip("/")
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)
        self._is_chat = is_chat_model
        self._template = chat_template or get_chat_template("default")

    @property
    def is_chat_model(self) -> bool:
        return self._is_chat

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template

    def _body(self, sampling: GenParams) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model}
        for key, value in sampling.sampling_params.items():
            if key in _TO_OPENAI:
                body[_TO_OPENAI[key]] = value
            elif key == "json_schema":
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "output", "schema": orjson.loads(value)}}
            elif key == "stop_token_ids":
                body["stop_token_ids"] = value
            elif key == "min_new_tokens":
                body["min_tokens"] = value
        if sampling.return_logprob:
            body["logprobs"] = True if self._is_chat else max(sampling.top_logprobs_num, 0)
            if self._is_chat and sampling.top_logprobs_num:
                body["top_logprobs"] = sampling.top_logprobs_num
        return body

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self._client.post(route, content=orjson.dumps(body), headers={"Content-Type": "application/json"})
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except Exception:
                message = r.text[:500]
            kind = ValueError if r.status_code == 400 else RuntimeError
            raise kind(f"{self.base_url}{route} answered {r.status_code}: {message}")
        return r.json()

    def generate(self, state_text: str, sampling: GenParams, *,
                 messages: list[dict[str, str]] | None = None) -> tuple[str, dict[str, Any]]:
        body = self._body(sampling)
        if self._is_chat:
            if messages is None:
                raise ValueError("an OpenAI chat model generates only at the start of an assistant turn: "
                                 "write s += assistant(gen(...)) with nothing before the gen in that turn")
            body["messages"] = messages
            out = self._post("/chat/completions", body)
            choice = out["choices"][0]
            text = choice["message"]["content"] or ""
        else:
            body["prompt"] = state_text
            out = self._post("/completions", body)
            choice = out["choices"][0]
            text = choice["text"]
        usage = out.get("usage") or {}
        meta = {"id": out.get("id"), "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                "finish_reason": {"type": choice.get("finish_reason")}}
        return text, meta

    def select(self, state_text: str, choices: Sequence[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        choices = check_choices(choices)
        regex = "(" + "|".join(re.escape(c) for c in choices) + ")"
        params = GenParams(sampling_params={"regex": regex, "temperature": 0.0,
                                            "max_new_tokens": 16 + max(len(c) for c in choices)})
        messages = None
        if self._is_chat:
            messages = [{"role": "user", "content": state_text}] if state_text else []
        text, meta = self.generate(state_text, params, messages=messages)
        picked = text.strip()
        if picked not in choices:
            raise ValueError(f"select needs a server that honours the 'regex' extra field (radixlang, SGLang, "
                             f"vLLM); {self.base_url} answered {text!r}, not one of {choices}")
        return ChoicesDecision(picked, {"method": "regex", **meta})

    def get_server_info(self) -> dict[str, Any]:
        return {"model": self.model, "base_url": self.base_url, "is_chat_model": self._is_chat}

    def shutdown(self) -> None:
        self._client.close()
