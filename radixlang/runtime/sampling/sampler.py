"""Batched sampling and logprobs.

Per row, in this order (``sample``):

1. tokens in ``min_tokens_blocked`` (EOS and stop ids before ``min_new_tokens``) get -inf;
2. penalties, over the tokens the request has generated so far (not its prompt): a token
   generated ``c > 0`` times has its logit ``l`` replaced by
   ``(l / repetition_penalty if l > 0 else l * repetition_penalty) - frequency_penalty * c - presence_penalty``;
   tokens never generated are unchanged;
3. greedy rows (temperature ~0 or top_k == 1) take the argmax;
4. other rows: ``p = softmax(l / temperature)``; sorted by descending ``p``, a token is kept while
   the mass before it is < top_p, its rank is < top_k (when top_k > 0) and ``p >= min_p * max(p)``
   (the most likely token is always kept); one token is drawn from the kept ones, renormalized.

Each request draws its randomness from its own generator when it has a
``sampling_seed`` (seeded by (seed, step)), so its samples do not depend on
which other requests share the batch. Unseeded requests share the engine's
generator.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from radixlang.runtime.sampling.sampling_params import SamplingParams

__all__ = ["SamplingParams", "SamplingInfo", "sample", "verify_draft", "apply_logit_bias", "compute_logprobs",
           "TopLogprobs"]

_MASK64 = (1 << 63) - 1


@dataclass(kw_only=True)
class SamplingInfo:
    """Per-row sampling options for one batch of next-token logits."""
    params: list[SamplingParams]
    output_ids: list[list[int]]  # tokens generated so far per row (penalties, seeded steps)
    min_tokens_blocked: list[list[int]]  # token ids banned this step per row (EOS before min_new_tokens)


def _apply_penalties(logits: torch.Tensor, info: SamplingInfo) -> None:
    """Repetition, then frequency and presence penalties, in place (the formula in the module docstring)."""
    for row, (p, out) in enumerate(zip(info.params, info.output_ids)):
        if not out or (p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 and p.repetition_penalty == 1.0):
            continue
        # counted on the host (torch.unique on the device would sync on its data-dependent size)
        tally = Counter(out)
        uniq = torch.tensor(list(tally), dtype=torch.int64).to(logits.device, non_blocking=True)
        counts = torch.tensor(list(tally.values()), dtype=torch.int64).to(logits.device, non_blocking=True)
        vals = logits[row, uniq]
        if p.repetition_penalty != 1.0:
            vals = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        vals = vals - p.frequency_penalty * counts.to(vals.dtype) - p.presence_penalty
        logits[row, uniq] = vals


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Add each row's logit_bias (token id -> bias) to logits [bs, vocab] in place (OpenAI's logit_bias)."""
    for row, p in enumerate(params):
        pairs = p.logit_bias_ids
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=logits.device)
            bias = torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
            logits[row].index_add_(0, ids, bias)


def _uniforms(info: SamplingInfo, generator: torch.Generator | None) -> torch.Tensor:
    draws = []  # drawn on the host (CPU generators: the same numbers on every device), moved once
    for p, out in zip(info.params, info.output_ids):
        if p.sampling_seed is not None:
            g = torch.Generator().manual_seed((p.sampling_seed * 1_000_003 + len(out)) & _MASK64)
            draws.append(torch.rand(1, generator=g))
        else:
            draws.append(torch.rand(1, generator=generator))
    return torch.cat(draws)


def _prepare(logits: torch.Tensor, info: SamplingInfo) -> None:
    """Steps 1 and 2 of the module docstring, in place: banned tokens, logit_bias, penalties."""
    for row, banned in enumerate(info.min_tokens_blocked):
        if banned:
            logits[row, banned] = float("-inf")
    apply_logit_bias(logits, info.params)
    _apply_penalties(logits, info)


def _kept_sorted(sub: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 4's filter over logits [n, vocab]: (probabilities sorted descending with the dropped ones zeroed,
    their token ids, how many are kept per row [n, 1])."""
    temps = torch.tensor([p.temperature for p in params], dtype=sub.dtype, device=sub.device)
    probs = torch.softmax(sub / temps[:, None], dim=-1)
    probs_sorted, order = torch.sort(probs, dim=-1, descending=True)
    cum = torch.cumsum(probs_sorted, dim=-1)
    keep = torch.ones_like(probs_sorted, dtype=torch.bool)
    top_ps = torch.tensor([p.top_p for p in params], dtype=sub.dtype, device=sub.device)
    keep &= (cum - probs_sorted) < top_ps[:, None]  # always keeps the first token
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else probs.shape[-1] for p in params], device=sub.device)
    ranks = torch.arange(probs.shape[-1], device=sub.device)[None, :]
    keep &= ranks < top_ks[:, None]
    min_ps = torch.tensor([p.min_p for p in params], dtype=sub.dtype, device=sub.device)
    keep &= probs_sorted >= (min_ps * probs_sorted[:, 0])[:, None]
    return probs_sorted * keep, order, keep.sum(-1, keepdim=True)


def _draw(probs_sorted: torch.Tensor, order: torch.Tensor, kept: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row from the (unnormalized) sorted kept probabilities; ``u`` [n] uniforms in [0, 1)."""
    cum = torch.cumsum(probs_sorted, dim=-1)
    target = (u.to(cum.device) * cum[:, -1])[:, None].to(cum.dtype)
    pick = torch.searchsorted(cum, target, right=True).clamp_(max=probs_sorted.shape[-1] - 1)
    # searchsorted can land on a zeroed tail entry only through rounding; step back to a kept one
    pick = torch.minimum(pick, kept - 1)
    return torch.gather(order, 1, pick).squeeze(1)


def sample(logits: torch.Tensor, info: SamplingInfo, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row. logits [bs, vocab] float32 (modified in place) -> [bs] int64."""
    _prepare(logits, info)
    greedy_rows = [i for i, p in enumerate(info.params) if p.is_greedy]
    result = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if len(greedy_rows) == len(info.params):
        return torch.argmax(logits, dim=-1)
    if greedy_rows:
        idx = torch.tensor(greedy_rows, dtype=torch.int64, device=logits.device)
        result[idx] = torch.argmax(logits[idx], dim=-1)
    rand_rows = [i for i, p in enumerate(info.params) if not p.is_greedy]
    idx = torch.tensor(rand_rows, dtype=torch.int64, device=logits.device)
    params = [info.params[i] for i in rand_rows]
    probs_sorted, order, kept = _kept_sorted(logits[idx], params)
    u = _uniforms(SamplingInfo(params=params, output_ids=[info.output_ids[i] for i in rand_rows],
                               min_tokens_blocked=[]), generator)
    result[idx] = _draw(probs_sorted, order, kept, u)
    return result


def verify_draft(logits: torch.Tensor, info: SamplingInfo, draft: int | None,
                 generator: torch.Generator | None = None) -> int:
    """Speculative decoding's test of one drafted token against the target's logits [1, vocab] (modified).

    Returns the token to append: ``draft`` itself when accepted, else a token drawn so that the result
    follows exactly what ``sample`` would draw. Greedy: the argmax (the draft is accepted iff it is the
    argmax). Sampled: a deterministic draft is accepted with probability p(draft); when rejected, the
    token comes from p with the draft removed, renormalized (rejection sampling with a one-hot proposal,
    so the output keeps the target distribution). ``draft`` None: a plain ``sample``.
    """
    _prepare(logits, info)
    p = info.params[0]
    if p.is_greedy:
        return int(torch.argmax(logits[0]))
    probs_sorted, order, kept = _kept_sorted(logits, [p])
    u = _uniforms(info, generator)  # the same draw ``sample`` would make at this step
    if draft is None:
        return int(_draw(probs_sorted, order, kept, u)[0])
    total = probs_sorted[0].sum()
    at = (order[0] == draft).nonzero()
    p_draft = probs_sorted[0, int(at[0, 0])] / total if at.numel() else torch.zeros(())
    if float(u[0]) < float(p_draft):
        return draft
    if at.numel():
        probs_sorted[0, int(at[0, 0])] = 0.0
    nonzero = (probs_sorted[0] > 0).nonzero()
    if not nonzero.numel():  # the draft held all the mass (accepted above but for rounding)
        return draft
    # the rejected branch draws again from a second uniform (seeded requests: the next one in their stream)
    u2 = _second_uniform(p, info.output_ids[0], generator)
    last = torch.tensor([[int(nonzero[-1, 0]) + 1]], device=probs_sorted.device)
    return int(_draw(probs_sorted, order, last, u2)[0])


def _second_uniform(p: SamplingParams, out: list[int], generator: torch.Generator | None) -> torch.Tensor:
    if p.sampling_seed is not None:
        g = torch.Generator().manual_seed((p.sampling_seed * 1_000_003 + len(out)) & _MASK64)
        return torch.rand(2, generator=g)[1:]
    return torch.rand(1, generator=generator)


@dataclass
class TopLogprobs:
    values: list[list[float]]
    ids: list[list[int]]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int = 0
                     ) -> tuple[list[float], TopLogprobs | None]:
    """logits [n, vocab], token_ids [n] -> logprob of each token, and the top_k per row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = token_ids.to(device=logp.device, dtype=torch.int64).view(-1, 1)  # host targets meet device logits
    chosen = torch.gather(logp, 1, ids).squeeze(1).tolist()
    if top_k <= 0:
        return chosen, None
    vals, ids = torch.topk(logp, k=min(top_k, logp.shape[-1]), dim=-1)
    return chosen, TopLogprobs(values=vals.tolist(), ids=ids.tolist())
