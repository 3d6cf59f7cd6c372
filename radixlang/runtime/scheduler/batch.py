"""Req (one request's state) and ScheduleBatch (what the scheduler runs in one step)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlang.constrained import CompiledGrammar, Grammar
from radixlang.radix_cache.scores import TokenScores, unknown_scores
from radixlang.kernels.attention.base import ForwardMode
from radixlang.runtime.io_struct import FinishReason
from radixlang.runtime.model_executor.forward_batch import StepInputs
from radixlang.runtime.model_executor.pooling import PooledRows
from radixlang.runtime.sampling.sampling_params import SamplingParams


@dataclass(eq=False, kw_only=True)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams  # as the front built it (frozen)
    max_new_tokens: int  # output tokens it may take: max_new_tokens, or the default, capped to the context left
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    # KV bookkeeping
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None  # radix node locked for this request
    kv_len: int = 0  # tokens of fill_ids whose KV is in the pool
    swa_freed_len: int = 0  # own tokens before this lost their window-layer KV (mem_cache/swa_req_cache.py)
    swa_window_released: bool = False  # its prefix lock no longer holds window KV (mem_cache/swa_req_cache.py)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (reported)
    cache_namespace: tuple | None = None  # the radix-tree namespace its KV is shared in (CachedReq)
    lora_id: int | None = None  # the LoRA adapter it runs under (runtime/lora/manager.py); None: the base model
    # output state
    finished_reason: FinishReason | None = None
    sent_output_len: int = 0  # output ids already sent to the detokenizer
    output_token_logprobs: list[list[float | int]] = field(default_factory=list)
    output_top_logprobs: list[list[list[float | int]]] = field(default_factory=list)
    input_token_logprobs: list[list[float | int | None]] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)
    sent_input_logprobs: bool = False
    cached_input_logprobs: int = 0  # input_token_logprobs entries admission took from the prefix cache
    grammar: Grammar | None = None  # set once grammar_future has completed
    grammar_future: Future[CompiledGrammar] | None = None  # a constrained request's grammar, compiling
    jump_forward_tokens: int = 0  # output tokens appended by jump-forward, not sampled
    # a logprob request's newest jump-forwarded tokens, whose logprobs the next extend computes, and
    # the finish a jump reached, held until then
    logprob_owed: int = 0
    finish_after_logprobs: FinishReason | None = None
    is_retracted: bool = False
    draft_state: Any = None  # the drafter's per-request state (speculative.py), built on its first drafted step
    spec_draft_tokens: int = 0  # tokens drafted for this request, and how many of them were accepted
    spec_accepted_tokens: int = 0
    pooled: PooledRows | None = None  # an embedding request's pooling (it samples nothing)
    embedding: list[float] | None = None  # its result, once its last prefill chunk ran
    # latency bookkeeping (time.monotonic seconds)
    arrival_time: float = 0.0
    last_token_time: float | None = None  # when the newest output token was appended

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building the whole list."""
        p = len(self.origin_input_ids)
        if end <= p:
            return self.origin_input_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.origin_input_ids[start:] + self.output_ids[:end - p]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.origin_input_ids[-1]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def input_logprob_start(self) -> int:
        """First prompt position reported in input_token_logprobs: ``logprob_start_len``, or the last prompt
        token for -1 (reported unscored)."""
        if not self.return_logprob:
            return self.prompt_len
        start = self.logprob_start_len
        return self.prompt_len - 1 if start < 0 else min(start, self.prompt_len - 1)

    @property
    def input_logit_start(self) -> int:
        """First prompt position whose logits a step must keep for input logprobs: the one before the first
        reported position, whose token is then scored. Position 0 has no left context and -1's last token
        is not asked for: those start the report unscored (None), as in SGLang's HTTP API, so a request
        means the same on the Engine and over HTTP."""
        start = self.input_logprob_start
        return start - 1 if self.logprob_start_len >= 1 else start

    @property
    def input_logprob_unscored_first(self) -> bool:
        """Whether the report starts with an unscored (None) entry: from position 0, or -1's last token."""
        return self.logprob_start_len < 1

    def prompt_scores(self, end: int) -> TokenScores | None:
        """The prompt logprobs reported so far, as scores of fill_ids[:end] for the prefix cache (NaN where
        none was computed); None when it has none (CachedReq)."""
        start = self.input_logprob_start
        known = min(end, start + len(self.input_token_logprobs), self.prompt_len)
        if not self.return_logprob or known <= start:
            return None
        nan = float("nan")
        k = self.top_logprobs_num
        out = unknown_scores(end, k)
        rows = self.input_token_logprobs[:known - start]
        out.logprobs[start:known] = torch.tensor([nan if v is None else v for v, _ in rows], dtype=torch.float32)
        if k and out.top_values is not None and out.top_ids is not None:
            tops = [row or [] for row in self.input_top_logprobs[:known - start]]
            out.top_values[start:known] = torch.tensor([[float(v) for v, _ in r] + [nan] * (k - len(r)) for r in tops],
                                                       dtype=torch.float32).view(-1, k)
            out.top_ids[start:known] = torch.tensor([[int(t) for _, t in r] + [0] * (k - len(r)) for r in tops],
                                                    dtype=torch.int32).view(-1, k)
        return out


@dataclass(eq=False, kw_only=True)
class ScheduleBatch:
    """The requests of one forward pass and, for EXTEND, how many tokens each appends."""
    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # new tokens per request
    prefix_lens: list[int]  # tokens already in the pool per request
    out_cache_loc: torch.Tensor  # [sum(extend_lens)] int64
    sample_mask: list[bool]  # False for a non-final prefill chunk: no token is sampled
    # True for a batch of running requests (decode; EXTEND when some extend by jump-forwarded tokens):
    # they stay in the running list, while the requests of a prefill batch join it
    from_running: bool = False
    # speculative decoding: per request the drafted tokens that follow its pending ones (counted in
    # extend_lens, not yet in the request's output); None when the step drafts nothing
    drafts: list[list[int]] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    def step_inputs(self, logit_rows: list[int]) -> StepInputs:
        """The model runner's host inputs for this batch; ``logit_rows``: the token rows to score."""
        reqs = self.reqs
        if self.mode is ForwardMode.DECODE:
            input_ids = [r.last_token for r in reqs]
            positions = [r.seq_len - 1 for r in reqs]
            seq_lens = [r.seq_len for r in reqs]
        else:
            input_ids, positions, seq_lens = [], [], []
            drafts = self.drafts or [[]] * len(reqs)
            for r, pre, ext, d in zip(reqs, self.prefix_lens, self.extend_lens, drafts):
                input_ids.extend(r.tokens(pre, pre + ext - len(d)))
                input_ids.extend(d)
                positions.extend(range(pre, pre + ext))
                seq_lens.append(pre + ext)
        return StepInputs(mode=self.mode, input_ids=torch.tensor(input_ids, dtype=torch.int64),
                          positions=torch.tensor(positions, dtype=torch.int64),
                          req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64),
                          seq_lens=seq_lens, prefix_lens=list(self.prefix_lens),
                          extend_lens=list(self.extend_lens), out_cache_loc=self.out_cache_loc,
                          logit_rows=torch.tensor(logit_rows, dtype=torch.int64),
                          prompt_lens=[r.prompt_len for r in reqs],
                          lora_ids=([r.lora_id for r in reqs] if any(r.lora_id is not None for r in reqs)
                                    else None))
