"""Backend: what the interpreter needs from a model.

Invariants every implementation keeps:
- Text in, text out. The interpreter sends the program's whole text so far
  (``state_text``); the backend never keeps per-program state between calls, so
  prefix reuse is the runtime's job (its radix cache), not the backend's.
- ``generate`` returns only the new text (never the prompt) and a meta dict in
  SGLang's ``meta_info`` shape (prompt_tokens, completion_tokens, cached_tokens,
  finish_reason, and the logprob lists when asked for). A request the runtime
  aborts raises RuntimeError; a request it rejects raises ValueError.
- ``select`` scores every choice as a continuation of ``state_text`` with
  prefill-only requests (no token is sampled) and returns a ChoicesDecision whose
  ``decision`` is one of ``choices``; it has no side effect but cache warming.
- ``cache_prefix`` is a hint: a prefill-only request whose only effect is that
  the prompt's KV stays in the runtime's prefix cache; backends without a cache
  make it a no-op.
- Methods may be called from many threads at once (run_batch, fork branches).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from radixlang.lang.chat_template import ChatTemplate, get_chat_template
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod


@dataclass(frozen=True)
class GenParams:
    """One gen's resolved request: sampling_params in /generate wire names plus the logprob options."""
    sampling_params: dict[str, Any] = field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False

    def to_payload(self, text: str | list[str], *, stream: bool = False) -> dict[str, Any]:
        """The body of SGLang's native POST /generate."""
        body: dict[str, Any] = {"text": text, "sampling_params": dict(self.sampling_params)}
        if self.return_logprob:
            body.update(return_logprob=True, top_logprobs_num=self.top_logprobs_num,
                        return_text_in_logprobs=self.return_text_in_logprobs)
            if self.logprob_start_len is not None:
                body["logprob_start_len"] = self.logprob_start_len
        if stream:
            body["stream"] = True
        return body


class Backend:
    """Base class; subclasses override generate and select at least."""

    def generate(self, state_text: str, sampling: GenParams, *,
                 messages: list[dict[str, str]] | None = None) -> tuple[str, dict[str, Any]]:
        """New text after ``state_text`` and its meta info. ``messages`` (OpenAI form) is given when the
        gen opens an assistant turn, for backends that speak chat instead of text."""
        raise NotImplementedError

    def generate_stream(self, state_text: str, sampling: GenParams, *,
                        messages: list[dict[str, str]] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield (delta, meta so far); the deltas concatenate to what generate would return."""
        text, meta = self.generate(state_text, sampling, messages=messages)
        yield text, meta

    def select(self, state_text: str, choices: Sequence[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        raise NotImplementedError

    def cache_prefix(self, prefix_text: str) -> None:
        """Prefill ``prefix_text`` so that later requests starting with it hit the cache."""

    @property
    def chat_template(self) -> ChatTemplate:
        return get_chat_template("default")

    @property
    def is_chat_model(self) -> bool:
        """True when roles travel as messages (OpenAI chat) rather than as template text."""
        return False

    def end_program(self, states: Sequence[Any]) -> None:
        """Called once per finished run (with its states); nothing to release by default."""

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def flush_cache(self) -> bool:
        return False

    def shutdown(self) -> None:
        """Release what the backend owns (a client, a child process); never an Engine it was given."""


def check_choices(choices: Sequence[str]) -> list[str]:
    choices = list(choices)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"choices must be a non-empty list of non-empty strings, got {choices!r}")
    return choices


def raise_if_aborted(meta: dict[str, Any], where: str) -> None:
    reason = meta.get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise RuntimeError(f"{where}: request aborted: {reason.get('message', 'no message')}")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share (where a choice's own tokens start)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
