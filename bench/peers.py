"""Peer systems for bench.run_all that need optional packages: llama.cpp (llama-cpp-python) and outlines.

Each is a DSL Backend; the systems in bench/systems.py open them only when their package imports,
and otherwise skip them with a message. Neither is a dependency of radixlang or of its tests.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Sequence

import numpy as np

from radixlang.lang.backends.base import Backend, GenParams, check_choices, common_prefix_len
from radixlang.lang.chat_template import ChatTemplate, from_jinja, match_chat_template
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod, decide



def _stops(params: dict[str, Any]) -> list[str]:
    stop = params.get("stop") or []
    return [stop] if isinstance(stop, str) else list(stop)


class LlamaCppBackend(Backend):
    """llama.cpp on the same GGUF, serving one request at a time as its server does with one slot.

    Prefix reuse is llama.cpp's default: ``Llama.generate`` keeps the KV of the longest common
    prefix between the new prompt and the previous one (one cached sequence, no tree), so the
    counters report that prefix as cached tokens. ``select`` scores each choice's tokens from the
    logits of a second context created with ``logits_all=True`` (the only way llama-cpp-python keeps
    per-position logits), reusing that context's prefix the same way. JSON-schema gens use
    llama.cpp's own grammar sampling (``LlamaGrammar.from_json_schema``); regex is not supported.
    """

    def __init__(self, gguf_path: str, model_dir: str, *, n_threads: int = 2, n_ctx: int = 2048) -> None:
        from llama_cpp import Llama
        self._make = lambda **kw: Llama(model_path=gguf_path, n_threads=n_threads, n_threads_batch=n_threads,
                                        n_ctx=n_ctx, seed=0, verbose=False, **kw)
        self.llm = self._make()
        self._scorer: Any = None  # the logits_all context, made on the first select
        self.model_dir = model_dir
        self._lock = threading.Lock()
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0

    def _encode(self, llm: Any, text: str) -> list[int]:
        return list(llm.tokenize(text.encode("utf-8"), add_bos=True, special=True))

    def _reused(self, llm: Any, ids: list[int]) -> int:
        # what Llama.generate keeps: the common prefix with the last sequence, minus one token to re-eval
        return min(common_prefix_len(llm.input_ids[:llm.n_tokens].tolist(), ids), len(ids) - 1)

    def generate(self, state_text: str, sampling: GenParams, *,
                 messages: list[dict[str, str]] | None = None) -> tuple[str, dict[str, Any]]:
        params = sampling.sampling_params
        if params.get("regex") or params.get("ebnf"):
            raise ValueError("the llama.cpp system runs JSON-schema grammars only, not regex/EBNF")
        if params.get("temperature", 1.0) != 0:
            raise ValueError("the llama.cpp system is benchmarked greedy (temperature 0) only")
        grammar = None
        if params.get("json_schema"):
            from llama_cpp import LlamaGrammar
            schema = params["json_schema"]
            grammar = LlamaGrammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                                    verbose=False)
        with self._lock:
            ids = self._encode(self.llm, state_text)
            cached = max(self._reused(self.llm, ids), 0)
            out = self.llm.create_completion(prompt=ids, max_tokens=int(params.get("max_new_tokens", 16)),
                                             temperature=0.0, top_k=1, repeat_penalty=1.0, stop=_stops(params),
                                             grammar=grammar)
            choice, usage = out["choices"][0], out["usage"]
            self.prompt_tokens += len(ids)
            self.cached_tokens += cached
            self.completion_tokens += usage["completion_tokens"]
        return choice["text"], {"prompt_tokens": len(ids), "completion_tokens": usage["completion_tokens"],
                                "cached_tokens": cached, "finish_reason": {"type": choice["finish_reason"]}}

    def select(self, state_text: str, choices: Sequence[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        choices = check_choices(choices)
        rows = []
        with self._lock:
            if self._scorer is None:
                self._scorer = self._make(logits_all=True)
            llm = self._scorer
            prefix_ids = self._encode(llm, state_text)
            for c in choices:
                ids = self._encode(llm, state_text + c)
                keep = max(self._reused(llm, ids), 0)
                llm.n_tokens = keep  # eval() drops the KV past n_tokens, so the shared prefix is reused
                llm.eval(ids[keep:])
                start = min(max(common_prefix_len(prefix_ids, ids), 1), len(ids) - 1)
                logits = llm.scores[start - 1:len(ids) - 1].astype(np.float64)  # [num_choice_tokens, vocab]
                logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
                rows.append([(float(logp[i, t]), t, None) for i, t in enumerate(ids[start:])])
                self.prompt_tokens += len(ids)
                self.cached_tokens += keep
        return decide(choices_method, choices, rows, None)

    def flush_cache(self) -> bool:
        """Forget the cached sequence, so each workload starts cold as on the other systems."""
        with self._lock:
            for llm in (self.llm, self._scorer):
                if llm is not None:
                    llm.reset()
        return True

    def counters(self) -> Any:
        from bench.systems import Counters
        with self._lock:
            return Counters(self.prompt_tokens, self.cached_tokens, self.completion_tokens)

    def shutdown(self) -> None:
        for llm in (self.llm, self._scorer):
            if llm is not None:
                llm.close()

    @property
    def chat_template(self) -> ChatTemplate:
        source = self.llm.metadata.get("tokenizer.chat_template")
        derived = None
        if isinstance(source, str):
            bos = self.llm.detokenize([self.llm.token_bos()], special=True).decode(errors="replace")
            eos = self.llm.detokenize([self.llm.token_eos()], special=True).decode(errors="replace")
            derived = from_jinja(source, bos_token=bos, eos_token=eos)
        return derived or match_chat_template(self.model_dir)


class OutlinesBackend(Backend):
    """outlines' JSON-schema generation over transformers (greedy), for the JSON workloads only."""

    def __init__(self, model_dir: str) -> None:
        import outlines
        from transformers import AutoTokenizer

        from bench.common import load_hf
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        hf = load_hf(model_dir)
        self.model = outlines.from_transformers(hf, self.tokenizer)
        self.model_dir = model_dir
        self._lock = threading.Lock()
        self.prompt_tokens = self.completion_tokens = 0

    def generate(self, state_text: str, sampling: GenParams, *,
                 messages: list[dict[str, str]] | None = None) -> tuple[str, dict[str, Any]]:
        from outlines.types import JsonSchema
        params = sampling.sampling_params
        schema = params.get("json_schema")
        if not schema:
            raise ValueError("the outlines system runs the JSON-schema workloads only")
        schema = schema if isinstance(schema, str) else json.dumps(schema)
        with self._lock:
            text = self.model(state_text, JsonSchema(schema), max_new_tokens=int(params.get("max_new_tokens", 16)),
                              do_sample=False)
            n_prompt = len(self.tokenizer.encode(state_text, add_special_tokens=False))
            n_out = len(self.tokenizer.encode(text, add_special_tokens=False))
            self.prompt_tokens += n_prompt
            self.completion_tokens += n_out
        return text, {"prompt_tokens": n_prompt, "completion_tokens": n_out, "cached_tokens": 0,
                      "finish_reason": {"type": "stop"}}

    def select(self, state_text: str, choices: Sequence[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        raise ValueError("the outlines system runs the JSON-schema workloads only")

    def counters(self) -> Any:
        from bench.systems import Counters
        with self._lock:
            return Counters(self.prompt_tokens, 0, self.completion_tokens)

    @property
    def chat_template(self) -> ChatTemplate:
        source = getattr(self.tokenizer, "chat_template", None)
        derived = from_jinja(source) if isinstance(source, str) else None
        return derived or match_chat_template(self.model_dir)
