"""A scripted, deterministic backend that records every call."""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from radixlang.lang.backends.base import Backend, GenParams
from radixlang.lang.chat_template import ChatTemplate, get_chat_template
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod, decide


def _default_gen(text: str, params: GenParams) -> str:
    return f"<{len(text)}>"


def _default_score(text: str, choice: str, i: int) -> float:
    return -1.0  # every token equally likely


class FakeBackend(Backend):
    """generate -> gen_fn(text, params); select scores each character of a choice as one token
    with score_fn(text, choice, i); cache_prefix only records."""

    def __init__(self, gen_fn: Callable[[str, GenParams], str] = _default_gen,
                 score_fn: Callable[[str, str, int], float] = _default_score, *,
                 template: ChatTemplate | None = None, fail_on: str | None = None,
                 gate: threading.Event | None = None) -> None:
        self.gen_fn = gen_fn
        self.score_fn = score_fn
        self.template = template or get_chat_template("default")
        self.fail_on = fail_on  # a substring of the prompt that makes generate raise
        self.gate = gate  # when given, generate waits for it (to observe the body running ahead)
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def _record(self, kind: str, payload: Any) -> None:
        with self._lock:
            self.calls.append((kind, payload))

    def of_kind(self, kind: str) -> list[Any]:
        with self._lock:
            return [p for k, p in self.calls if k == kind]

    def generate(self, state_text: str, sampling: GenParams, *, messages=None) -> tuple[str, dict[str, Any]]:
        if self.gate is not None:
            assert self.gate.wait(10)
        self._record("generate", (state_text, sampling, messages))
        if self.fail_on is not None and self.fail_on in state_text:
            raise RuntimeError(f"scripted failure on {self.fail_on!r}")
        out = self.gen_fn(state_text, sampling)
        for stop in sampling.sampling_params.get("stop", []):
            if stop in out:
                out = out[:out.index(stop)]
        return out, {"prompt_tokens": len(state_text), "completion_tokens": len(out), "cached_tokens": 0,
                     "finish_reason": {"type": "stop", "matched": None}}

    def generate_stream(self, state_text: str, sampling: GenParams, *, messages=None):
        text, meta = self.generate(state_text, sampling, messages=messages)
        for i in range(0, len(text), 2):
            yield text[i:i + 2], meta

    def select(self, state_text: str, choices: Sequence[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        self._record("select", (state_text, list(choices), temperature, choices_method))
        rows = [[(self.score_fn(state_text, c, i), ord(ch), ch) for i, ch in enumerate(c)] for c in choices]
        uncond = [[(-1.0, ord(ch), ch) for ch in c] for c in choices]
        return decide(choices_method, choices, rows, uncond)

    def cache_prefix(self, prefix_text: str) -> None:
        self._record("cache_prefix", prefix_text)

    @property
    def chat_template(self) -> ChatTemplate:
        return self.template

    def get_server_info(self) -> dict[str, Any]:
        return {"fake": True}

    def flush_cache(self) -> bool:
        self._record("flush_cache", None)
        return True
