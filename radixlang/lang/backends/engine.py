"""EngineBackend: the DSL on an in-process radixlang Engine (no HTTP).

The only lang module that may touch the runtime, and only through the Engine
object it is given (no runtime import at module level). Select tokenizes here,
so each choice's tokens are known exactly even when the tokenizer merges across
the prefix/choice boundary.
"""
from __future__ import annotations

import threading
from typing import Any, Iterator, Sequence

from radixlang.lang.backends.base import Backend, GenParams, check_choices, common_prefix_len, raise_if_aborted
from radixlang.lang.chat_template import ChatTemplate, from_jinja, match_chat_template
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod, decide


class EngineBackend(Backend):
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._template: ChatTemplate | None = None
        self._lock = threading.Lock()

    # ---- generation --------------------------------------------------------------------------
    def _kwargs(self, sampling: GenParams) -> dict[str, Any]:
        return {"sampling_params": dict(sampling.sampling_params), "return_logprob": sampling.return_logprob,
                "logprob_start_len": sampling.logprob_start_len, "top_logprobs_num": sampling.top_logprobs_num}

    def _with_text(self, meta: dict[str, Any], sampling: GenParams) -> dict[str, Any]:
        if not (sampling.return_logprob and sampling.return_text_in_logprobs):
            return meta
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if key in meta:
                meta[key] = [(lp, tid, self.tokenizer.decode([tid])) for lp, tid, _ in meta[key]]
        return meta

    def generate(self, state_text: str, sampling: GenParams, *,
                 messages: list[dict[str, str]] | None = None) -> tuple[str, dict[str, Any]]:
        out = self.engine.generate(prompt=state_text, **self._kwargs(sampling))
        raise_if_aborted(out["meta_info"], "engine generate")
        return out["text"], self._with_text(out["meta_info"], sampling)

    def generate_stream(self, state_text: str, sampling: GenParams, *,
                        messages: list[dict[str, str]] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        sent = 0
        for snap in self.engine.generate(prompt=state_text, stream=True, **self._kwargs(sampling)):
            raise_if_aborted(snap["meta_info"], "engine generate")
            text = snap["text"]
            if len(text) > sent:
                yield text[sent:], snap["meta_info"]
                sent = len(text)

    # ---- select ------------------------------------------------------------------------------
    def select(self, state_text: str, choices: Sequence[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        choices = check_choices(choices)
        encode = self._encode
        prefix_ids = encode(state_text)
        if len(prefix_ids) > 1:
            self._prefill(prefix_ids)  # the shared prefix is computed once; the choices hit the cache
        full = [encode(state_text + c) for c in choices]
        starts = [max(common_prefix_len(prefix_ids, ids), 1) for ids in full]
        outs = self._batch(full, starts)
        rows = []
        for out in outs:
            raise_if_aborted(out["meta_info"], "engine select")
            scored = out["meta_info"]["input_token_logprobs"]  # from the first choice token, each scored
            rows.append([(lp, tid, self.tokenizer.decode([tid])) for lp, tid, _ in scored])
        uncond = None
        if choices_method.requires_unconditional_logprobs:
            uncond = self._unconditional([[tid for _, tid, _ in r] for r in rows])
        decision = decide(choices_method, choices, rows, uncond)
        decision.meta_info["prompt_tokens"] = [o["meta_info"]["prompt_tokens"] for o in outs]
        decision.meta_info["cached_tokens"] = [o["meta_info"]["cached_tokens"] for o in outs]
        return decision

    def _batch(self, full: list[list[int]], starts: list[int]) -> list[dict[str, Any]]:
        # logprob_start_len = the first choice token (>= 1, so it is scored too); one generate call per
        # distinct start (the engine takes one logprob_start_len per call)
        outs: list[dict[str, Any] | None] = [None] * len(full)
        for start in sorted(set(starts)):
            idx = [i for i, s in enumerate(starts) if s == start]
            res = self.engine.generate(input_ids=[full[i] for i in idx],
                                       sampling_params={"max_new_tokens": 0, "temperature": 0.0},
                                       return_logprob=True, logprob_start_len=start)
            for i, r in zip(idx, res):
                outs[i] = r
        return outs  # type: ignore[return-value]

    def _unconditional(self, token_rows: list[list[int]]) -> list[list[tuple]]:
        res = self.engine.generate(input_ids=[r or [0] for r in token_rows], sampling_params={"max_new_tokens": 0},
                                   return_logprob=True, logprob_start_len=0)
        return [[(lp, tid, None) for lp, tid, _ in out["meta_info"]["input_token_logprobs"]][:len(r)]
                for out, r in zip(res, token_rows)]

    def _encode(self, text: str) -> list[int]:
        # as the engine tokenizes a text prompt (a BOS where the model asks for one), so that select scores
        # the prompt generate sees and hits its cached prefix
        from radixlang.runtime.tokenizer_source import encode_prompt
        return encode_prompt(self.tokenizer, text)

    def _prefill(self, ids: list[int]) -> dict[str, Any]:
        out = self.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
        raise_if_aborted(out["meta_info"], "engine cache_prefix")
        return out["meta_info"]

    def cache_prefix(self, prefix_text: str) -> None:
        if prefix_text:
            self._prefill(self._encode(prefix_text))

    # ---- info --------------------------------------------------------------------------------
    @property
    def chat_template(self) -> ChatTemplate:
        with self._lock:
            if self._template is None:
                tok = self.tokenizer
                source = getattr(tok, "chat_template", None)
                derived = from_jinja(source, bos_token=getattr(tok, "bos_token", "") or "",
                                     eos_token=getattr(tok, "eos_token", "") or "") if isinstance(source, str) else None
                path = getattr(getattr(self.engine, "server_args", None), "model_path", None)
                self._template = derived or match_chat_template(path)
            return self._template

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())
