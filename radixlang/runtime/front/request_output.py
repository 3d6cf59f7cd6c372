"""What both fronts of the runtime share: turning a call into requests, and one request's output.

``expand_requests`` validates and tokenizes a ``generate`` call (one prompt or many,
n expanded in order); ``RequestOutput`` accumulates the ``BatchStrOut`` rows of one
request into the dict a caller gets (text, output_ids, meta_info). The in-process
Engine and the server's TokenizerManager both use them, so the two answer alike.
"""
from __future__ import annotations

from typing import Any

from radixlang.runtime.io_struct import TextRow
from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.errors import RequestError
from radixlang.runtime.tokenizer_source import encode_prompt

Item = tuple[list[int], "str | None", SamplingParams]  # (input_ids, prompt text, its params: one per copy of n)


def expand_requests(tokenizer: Any, prompt: str | list[str] | None, sampling_params: dict | list[dict] | None,
                    input_ids: list[int] | list[list[int]] | None,
                    defaults: dict[str, Any] | None = None) -> list[Item]:
    """One item per request the scheduler will see, its prompt tokenized and its params built and validated
    here, once (n copies share one frozen SamplingParams), a field it leaves unset taking the model's default
    (``defaults``: runtime/generation_config.py); raises RequestError on a malformed call."""
    if (prompt is None) == (input_ids is None):
        raise RequestError("give exactly one of prompt (text) or input_ids", "text")
    if prompt is not None:
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not all(isinstance(t, str) for t in texts):
            raise RequestError("prompt must be a string or a list of strings", "text")
        ids = [encode_prompt(tokenizer, t) for t in texts]  # BOS / EOS as the model's tokenizer asks
    else:
        single = bool(input_ids) and isinstance(input_ids[0], int)
        ids = [list(input_ids)] if single else [list(x) for x in input_ids]
        texts = [None] * len(ids)
    if isinstance(sampling_params, list):
        if len(sampling_params) != len(ids):
            raise RequestError(f"sampling_params has {len(sampling_params)} entries for {len(ids)} prompts",
                               "sampling_params")
        plist = [SamplingParams.from_dict({**(defaults or {}), **(p or {})}) for p in sampling_params]
    else:
        plist = [SamplingParams.from_dict({**(defaults or {}), **(sampling_params or {})})] * len(ids)
    return [(i, t, p) for i, t, p in zip(ids, texts, plist) for _ in range(p.n)]


def is_batched(prompt: Any, input_ids: Any, num_items: int) -> bool:
    """Whether the call answers with a list (many prompts, or n > 1) rather than one dict."""
    return (prompt is not None and not isinstance(prompt, str)) or \
        (input_ids is not None and not (input_ids and isinstance(input_ids[0], int))) or num_items > 1


class RequestOutput:
    """One request's accumulated output."""

    def __init__(self, rid: str, *, return_logprob: bool = False) -> None:
        self.rid = rid
        self.text = ""
        self.output_ids: list[int] = []
        self.meta: dict[str, Any] = {"id": rid}
        self.lp: dict[str, list] = {"input_token_logprobs": [], "output_token_logprobs": [],
                                    "input_top_logprobs": [], "output_top_logprobs": []}
        self.return_logprob = return_logprob
        self.embedding: list[float] | None = None  # an embedding request's, once it finished
        self.done = False

    def update(self, row: TextRow) -> None:
        """Add this request's newest piece."""
        self.text += row.text_delta
        self.output_ids.extend(row.output_ids)
        self.meta.update(prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens,
                         cached_tokens=row.cached_tokens, finish_reason=row.finished_reason)
        self.meta.update(row.extra_meta)
        if row.embedding is not None:
            self.embedding = row.embedding
        for key in self.lp:
            vals = getattr(row, key)
            if vals:
                self.lp[key].extend(vals)
        self.done = row.finished_reason is not None

    def fail(self, message: str) -> None:
        """End the request with an abort that no scheduler sent (its process or thread died)."""
        self.meta["finish_reason"] = {"type": "abort", "message": message}
        self.done = True

    def snapshot(self) -> dict[str, Any]:
        meta = dict(self.meta)
        if self.return_logprob:
            meta["input_token_logprobs"] = [(lp, tid, None) for lp, tid in self.lp["input_token_logprobs"]]
            meta["output_token_logprobs"] = [(lp, tid, None) for lp, tid in self.lp["output_token_logprobs"]]
            meta["input_top_logprobs"] = [None if row is None else [(lp, tid, None) for lp, tid in row]
                                          for row in self.lp["input_top_logprobs"]]
            meta["output_top_logprobs"] = [[(lp, tid, None) for lp, tid in row]
                                           for row in self.lp["output_top_logprobs"]]
        snap = {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
        if self.embedding is not None:
            snap["embedding"] = self.embedding
        return snap
