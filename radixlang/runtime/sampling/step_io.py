"""A step's plan and its output: the plain data between the scheduler and the runner.

The scheduler decides (``StepPlan``): per request of the batch, which logit rows score known tokens
(prompt logprobs, jump-forwarded tokens' logprobs), and how it picks its next token: its sampling
params, what it generated so far, the ids banned this step, its grammar's bitmask per row, its drafts,
and which logprobs it wants. The runner executes (``sampling/step_sampler.py``: masks, sampling, draft
verification, logprobs) and returns ``StepOutput``: token ids and logprobs as host lists. The scheduler
only does bookkeeping from that output.

Logit rows are indices into the step's ``StepInputs.logit_rows`` (row i: the logits after token
``input_ids[logit_rows[i]]``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixlang.runtime.sampling.sampler import TopLogprobs, compute_logprobs
from radixlang.runtime.sampling.sampling_params import SamplingParams

# top_k (logprob, token id) pairs of one row, most likely first
TopRow = list[list[float | int]]


@dataclass(kw_only=True)
class Scored:
    """Rows whose logprobs of known tokens are owed: row ``first + i`` scores ``targets[i]``."""
    first: int
    targets: list[int]
    top_k: int = 0


@dataclass(kw_only=True)
class TokenChoice:
    """How one request picks its tokens from rows ``first``, ``first + 1``, ...: row j holds the next-token
    logits after j of its drafts. Without drafts it picks one token from row ``first``; with drafts the
    runner keeps each draft that the token chosen from its row equals, then appends that one token."""
    first: int
    params: SamplingParams
    output_ids: list[int]  # tokens generated so far (penalties, seeded draws); row j adds drafts[:j]
    min_tokens_blocked: list[list[int]]  # per row: ids banned there (EOS and stop ids before min_new_tokens)
    drafts: list[int] = field(default_factory=list)
    # [num_rows, ceil(vocab / 32)] int32 cpu: the grammar's bitmask per row (the grammar advanced along the
    # drafts); rows past the first draft the grammar rejects have none, and are never reached. None: no grammar
    masks: torch.Tensor | None = None
    logprobs: bool = False  # each chosen token's logprob from the masked row it was chosen from
    top_k: int = 0  # ... and that row's top_k
    unmasked: bool = False  # keep each row before its mask: a jump-forward may respell the token (UnmaskedRow)

    @property
    def num_rows(self) -> int:
        """The rows the runner may choose from: one per draft and one more, or as many as there are masks."""
        rows = len(self.drafts) + 1
        return min(rows, int(self.masks.shape[0])) if self.masks is not None else rows

    @property
    def plain_greedy(self) -> bool:
        """Whether each token is the argmax of its raw logits (no mask, bias, penalty, ban or logprobs)."""
        p = self.params
        return (p.is_greedy and self.masks is None and not self.logprobs and not self.unmasked
                and not p.logit_bias_ids and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
                and p.presence_penalty == 0.0 and not any(self.min_tokens_blocked))


@dataclass(kw_only=True)
class ReqPlan:
    """One request of the batch: what the runner computes for it (each part optional)."""
    prompt: Scored | None = None  # its prompt positions' logprobs
    owed: Scored | None = None  # its jump-forwarded tokens' logprobs (the extend computing their KV)
    choice: TokenChoice | None = None  # its next token(s); None: it picks nothing this step


@dataclass(kw_only=True)
class StepPlan:
    reqs: list[ReqPlan]  # one per request of the batch, in batch order
    # speculative drafts ride in this step: each request verifies row by row (in batch order, so unseeded
    # requests draw from the runner's generator in a fixed order); otherwise one batched sample
    verify: bool = False


@dataclass(kw_only=True)
class Logprobs:
    """Per scored row: the logprob of its token and, when asked, the row's top_k."""
    values: list[float]
    top: list[TopRow] | None = None

    @classmethod
    def of(cls, values: list[float], top: TopLogprobs | None) -> Logprobs:
        """From ``compute_logprobs``' result."""
        pairs = None if top is None else [[list(p) for p in zip(vs, ids)] for vs, ids in zip(top.values, top.ids)]
        return cls(values=values, top=pairs)


class UnmaskedRow:
    """A row's logits before its grammar mask, kept on the runner's device until scored: a token the
    jump-forward respelled was forced, not sampled, and gets its logprob from here."""

    def __init__(self, logits: torch.Tensor, top_k: int) -> None:
        self.logits = logits  # [1, vocab] float32
        self.top_k = top_k

    def logprob(self, token: int) -> tuple[float, TopRow | None]:
        """The token's logprob under this row, and the row's top_k (None when not asked)."""
        scored = Logprobs.of(*compute_logprobs(self.logits, torch.tensor([token]), self.top_k))
        return scored.values[0], scored.top[0] if scored.top is not None else None


@dataclass(kw_only=True)
class ReqOutput:
    prompt: Logprobs | None = None  # for ReqPlan.prompt
    owed: Logprobs | None = None  # for ReqPlan.owed
    tokens: list[int] = field(default_factory=list)  # the kept drafts, then the chosen token; empty: none chosen
    logprobs: Logprobs | None = None  # per token (TokenChoice.logprobs)
    unmasked: list[UnmaskedRow] = field(default_factory=list)  # per token (TokenChoice.unmasked)

    def token_logprob(self, j: int) -> tuple[float, TopRow | None] | None:
        """Token j's logprob and its row's top_k (None when not asked); None without logprobs."""
        if self.logprobs is None:
            return None
        return self.logprobs.values[j], self.logprobs.top[j] if self.logprobs.top is not None else None


@dataclass(kw_only=True)
class StepOutput:
    reqs: list[ReqOutput] = field(default_factory=list)  # one per ReqPlan
    # an embedding server (--is-embedding): the asked rows' final hidden states [len(logit_rows), hidden]
    hidden: torch.Tensor | None = None
