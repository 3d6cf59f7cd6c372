"""RuntimeEndpoint: the DSL over SGLang's native HTTP API (radixlang's or SGLang's server).

Routes used: POST /generate, GET /get_model_info, GET /get_server_info,
POST /flush_cache. Needs httpx only (no torch, no tokenizer): select measures
the shared prefix in tokens with a prefill-only request, as SGLang's client does.
"""
from __future__ import annotations

import threading
from typing import Any, Iterator, Sequence

import orjson

from radixlang.lang.backends.base import Backend, GenParams, check_choices, raise_if_aborted
from radixlang.lang.chat_template import ChatTemplate, from_jinja, match_chat_template
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod, decide


class RuntimeEndpoint(Backend):
    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 600.0,
                 transport: Any = None) -> None:
        import httpx
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)
        self._template: ChatTemplate | None = None
        self._model_info: dict[str, Any] | None = None
        self._lock = threading.Lock()

    # ---- HTTP --------------------------------------------------------------------------------
    def _check(self, r: Any, route: str) -> Any:
        if r.status_code == 200:
            return r.json() if r.content else {}
        try:
            message = r.json()["error"]["message"]
        except Exception:
            message = r.text[:500]
        if r.status_code == 400:
            raise ValueError(f"{self.base_url}{route} rejected the request: {message}")
        raise RuntimeError(f"{self.base_url}{route} answered {r.status_code}: {message}")

    def _post(self, route: str, body: dict[str, Any]) -> Any:
        return self._check(self._client.post(route, content=orjson.dumps(body),
                                             headers={"Content-Type": "application/json"}), route)

    def _get(self, route: str) -> Any:
        return self._check(self._client.get(route), route)

    # ---- generation --------------------------------------------------------------------------
    def generate(self, state_text: str, sampling: GenParams, *,
                 messages: list[dict[str, str]] | None = None) -> tuple[str, dict[str, Any]]:
        out = self._post("/generate", sampling.to_payload(state_text))
        raise_if_aborted(out["meta_info"], self.base_url)
        return out["text"], out["meta_info"]

    def generate_stream(self, state_text: str, sampling: GenParams, *,
                        messages: list[dict[str, str]] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        body = orjson.dumps(sampling.to_payload(state_text, stream=True))
        sent = 0
        with self._client.stream("POST", "/generate", content=body,
                                 headers={"Content-Type": "application/json"}) as r:
            if r.status_code != 200:
                r.read()
                self._check(r, "/generate")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                snap = orjson.loads(data)
                raise_if_aborted(snap["meta_info"], self.base_url)
                if len(snap["text"]) > sent:
                    yield snap["text"][sent:], snap["meta_info"]
                    sent = len(snap["text"])

    # ---- select ------------------------------------------------------------------------------
    def _prefill_len(self, text: str) -> int:
        out = self._post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 0}})
        raise_if_aborted(out["meta_info"], self.base_url)
        return int(out["meta_info"]["prompt_tokens"])

    def select(self, state_text: str, choices: Sequence[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        choices = check_choices(choices)
        prefix_len = self._prefill_len(state_text) if state_text else 0
        start = max(prefix_len - 1, 0)  # the last prefix token reports None; the choice tokens are scored
        outs = self._post("/generate", {"text": [state_text + c for c in choices],
                                        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                                        "return_logprob": True, "logprob_start_len": start,
                                        "return_text_in_logprobs": True})
        rows = []
        for out in outs:
            raise_if_aborted(out["meta_info"], self.base_url)
            rows.append([tuple(t) for t in out["meta_info"]["input_token_logprobs"][1 if prefix_len else 0:]])
        uncond = None
        if choices_method.requires_unconditional_logprobs:
            res = self._post("/generate", {"input_ids": [[t[1] for t in r] for r in rows],
                                           "sampling_params": {"max_new_tokens": 0},
                                           "return_logprob": True, "logprob_start_len": 0})
            uncond = [[tuple(t) for t in o["meta_info"]["input_token_logprobs"]] for o in res]
        decision = decide(choices_method, choices, rows, uncond)
        decision.meta_info["cached_tokens"] = [o["meta_info"].get("cached_tokens") for o in outs]
        return decision

    def cache_prefix(self, prefix_text: str) -> None:
        if prefix_text:
            self._prefill_len(prefix_text)

    # ---- info --------------------------------------------------------------------------------
    def get_model_info(self) -> dict[str, Any]:
        with self._lock:
            if self._model_info is None:
                self._model_info = self._get("/get_model_info")
            return self._model_info

    @property
    def chat_template(self) -> ChatTemplate:
        info = self.get_model_info()
        with self._lock:
            if self._template is None:
                source = info.get("chat_template")
                derived = from_jinja(source) if isinstance(source, str) else None
                self._template = derived or match_chat_template(info.get("model_path"))
            return self._template

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def flush_cache(self) -> bool:
        try:
            self._post("/flush_cache", {})
        except ValueError:
            return False
        return True

    def shutdown(self) -> None:
        self._client.close()
