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

__all__ = ["SamplingParams", "SamplingInfo", "sample", "apply_logit_bias", "compute_logprobs", "TopLogprobs"]

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


def sample(logits: torch.Tensor, info: SamplingInfo, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row. logits [bs, vocab] float32 (modified in place) -> [bs] int64."""
    for row, banned in enumerate(info.min_tokens_blocked):
        if banned:
            logits[row, banned] = float("-inf")
    apply_logit_bias(logits, info.params)
    _apply_penalties(logits, info)
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
    sub = logits[idx]  # [n, vocab]
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
    probs_sorted = probs_sorted * keep
    cum = torch.cumsum(probs_sorted, dim=-1)
    u = _uniforms(SamplingInfo(params=params, output_ids=[info.output_ids[i] for i in rand_rows],
                               min_tokens_blocked=[]), generator).to(sub.device) * cum[:, -1]
    pick = torch.searchsorted(cum, u[:, None].to(cum.dtype), right=True).clamp_(max=probs.shape[-1] - 1)
    # searchsorted can land on a zeroed tail entry only through rounding; step back to a kept one
    pick = torch.minimum(pick, keep.sum(-1, keepdim=True) - 1)
    result[idx] = torch.gather(order, 1, pick).squeeze(1)
    return result


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
