"""A step's token choice on the runner: from the step's logits and the scheduler's ``StepPlan`` to a
``StepOutput`` (token ids and logprobs as host lists; step_io.py). What a model runner does after its
forward (rank 0 only under tensor parallelism), and what a test's scripted runner does after it.

Per step, in this order: the owed logprobs of prompt and jump-forwarded rows; then either one batched
``sample`` over every choosing request's row (its grammar mask applied first), or, when drafts ride in
the step, each request's rows verified in turn (``verify_draft``), stopping at the first draft the
chosen token differs from. Requests whose tokens are plain argmaxes share one argmax over all their rows.
A request that wants logprobs gets each chosen token's logprob from its masked row before the sampling
filters (penalties, bans), as the token it was chosen from.
"""
from __future__ import annotations

import torch

from radixlang.kernels.bitmask import allocate_token_bitmask, apply_token_bitmask_inplace
from radixlang.runtime.sampling.sampler import SamplingInfo, compute_logprobs, sample, verify_draft
from radixlang.runtime.sampling.step_io import (Logprobs, ReqOutput, Scored, StepOutput, StepPlan, TokenChoice,
                                                UnmaskedRow)


def run_plan(logits: torch.Tensor, plan: StepPlan, generator: torch.Generator | None) -> StepOutput:
    """logits [len(logit_rows), vocab] float32 on the runner's device (its choosing rows are read, not
    changed) -> one ``ReqOutput`` per ``plan.reqs``."""
    outs = [ReqOutput() for _ in plan.reqs]
    for rp, out in zip(plan.reqs, outs):
        if rp.prompt is not None:
            out.prompt = _score(logits, rp.prompt)
        if rp.owed is not None:
            out.owed = _score(logits, rp.owed)
    chosen = [(out, rp.choice) for rp, out in zip(plan.reqs, outs) if rp.choice is not None]
    if plan.verify:
        _verify(logits, chosen, generator)
    elif chosen:
        _sample(logits, chosen, generator)
    return StepOutput(reqs=outs)


def _score(logits: torch.Tensor, scored: Scored) -> Logprobs:
    n = len(scored.targets)
    targets = torch.tensor(scored.targets, dtype=torch.int64)
    return Logprobs.of(*compute_logprobs(logits[scored.first:scored.first + n], targets, scored.top_k))


def _apply_masks(rows: torch.Tensor, masks: list[torch.Tensor | None]) -> None:
    """rows [n, vocab] in place: row i takes masks[i] ([words] int32 cpu) where one is given."""
    given = [(i, m) for i, m in enumerate(masks) if m is not None]
    if not given:
        return
    # filled on the CPU (where every grammar backend computes masks), then one copy to the logits' device
    full = allocate_token_bitmask(rows.shape[0], rows.shape[-1], "cpu")
    for i, m in given:
        full[i, :m.shape[-1]] = m
    if rows.device.type != "cpu":
        full = full.pin_memory().to(rows.device, non_blocking=True) if rows.is_cuda else full.to(rows.device)
    apply_token_bitmask_inplace(rows, full, [i for i, _ in given])


def _sample(logits: torch.Tensor, chosen: list[tuple[ReqOutput, TokenChoice]],
            generator: torch.Generator | None) -> None:
    """One token per request from its first row: masks, then one batched ``sample``."""
    choices = [c for _, c in chosen]
    rows = logits[[c.first for c in choices]]  # [n, vocab]: a copy, changed in place below
    unmasked = rows.clone() if any(c.unmasked for c in choices) else None
    _apply_masks(rows, [c.masks[0] if c.masks is not None else None for c in choices])
    raw = rows.clone() if any(c.logprobs for c in choices) else rows
    info = SamplingInfo(params=[c.params for c in choices], output_ids=[c.output_ids for c in choices],
                        min_tokens_blocked=[c.min_tokens_blocked[0] for c in choices])
    ids = sample(rows, info, generator).tolist()  # the one device-to-host read of a step's sampled tokens
    for i, ((out, c), tok) in enumerate(zip(chosen, ids)):
        out.tokens = [tok]
        if c.logprobs:
            out.logprobs = Logprobs.of(*compute_logprobs(raw[i:i + 1], torch.tensor([tok]), c.top_k))
        if unmasked is not None and c.unmasked:
            out.unmasked = [UnmaskedRow(unmasked[i:i + 1], c.top_k)]


def _verify(logits: torch.Tensor, chosen: list[tuple[ReqOutput, TokenChoice]],
            generator: torch.Generator | None) -> None:
    """Speculative decoding: each request keeps its drafts while the token chosen from a draft's row equals
    it, then appends that token (see ``verify_draft`` for sampled requests). Row j of a request holds the
    next-token logits after its pending token and j drafts: the token chosen from it is the one plain
    decoding would append there."""
    plain = [(out, c) for out, c in chosen if c.plain_greedy]
    if plain:  # one argmax over all their rows: the one device-to-host read for them
        top = torch.argmax(logits[[c.first + j for _, c in plain for j in range(c.num_rows)]], dim=-1).tolist()
        for out, c in plain:
            picked, top = top[:c.num_rows], top[c.num_rows:]
            out.tokens = _kept(picked, c.drafts)
    for out, c in chosen:
        if not c.plain_greedy:
            _verify_one(logits, out, c, generator)


def _kept(picked: list[int], drafts: list[int]) -> list[int]:
    """The drafts equal to the token picked at their row, then the first picked token that differs (or the one
    after the last draft)."""
    kept = []
    for j, tok in enumerate(picked):
        kept.append(tok)
        if j >= len(drafts) or tok != drafts[j]:
            break
    return kept


def _verify_one(logits: torch.Tensor, out: ReqOutput, c: TokenChoice, generator: torch.Generator | None) -> None:
    values: list[float] = []
    tops: list = []
    for j in range(c.num_rows):
        draft = c.drafts[j] if j < len(c.drafts) else None
        row = logits[c.first + j:c.first + j + 1].clone()
        if c.unmasked:
            out.unmasked.append(UnmaskedRow(row.clone(), c.top_k))
        if c.masks is not None:
            _apply_masks(row, [c.masks[j]])
        raw = row.clone() if c.logprobs else None
        info = SamplingInfo(params=[c.params], output_ids=[c.output_ids + c.drafts[:j]],
                            min_tokens_blocked=[c.min_tokens_blocked[j]])
        tok = verify_draft(row, info, draft, generator)
        out.tokens.append(tok)
        if raw is not None:
            vals, top = compute_logprobs(raw, torch.tensor([tok]), c.top_k)
            scored = Logprobs.of(vals, top)
            values += scored.values
            tops += scored.top or []
        if tok != draft:
            break
    if c.logprobs:
        out.logprobs = Logprobs(values=values, top=tops if c.top_k else None)
