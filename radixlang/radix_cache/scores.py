"""Per-token scores kept beside a node's KV: each token's logprob given every token before it, and
optionally its top-k alternatives, as first computed for a request that asked for prompt logprobs.

A position nobody scored holds NaN (a prefix inserted by a request that did not ask); a top-k row
holds as many leading non-NaN columns as the k it was computed with. Host memory per scored token:
4 bytes, plus 8 bytes per top-k column where top-k was asked for (float32 value, int32 id).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenScores:
    logprobs: torch.Tensor  # [n] float32, NaN where unknown
    top_values: torch.Tensor | None = None  # [n, k] float32 descending, NaN past a row's own k
    top_ids: torch.Tensor | None = None  # [n, k] int32

    def __len__(self) -> int:
        return int(self.logprobs.numel())

    def slice(self, start: int, end: int) -> TokenScores:
        if self.top_values is None or self.top_ids is None:
            return TokenScores(self.logprobs[start:end])
        return TokenScores(self.logprobs[start:end], self.top_values[start:end], self.top_ids[start:end])

    def top_width(self) -> int:
        return 0 if self.top_values is None else int(self.top_values.shape[1])

    def top_known(self) -> torch.Tensor:
        """[n] int64: how many top-k entries each position holds."""
        if self.top_values is None:
            return torch.zeros(len(self), dtype=torch.int64)
        return (~torch.isnan(self.top_values)).sum(dim=1)


def unknown_scores(n: int, top_width: int = 0) -> TokenScores:
    lp = torch.full((n,), float("nan"), dtype=torch.float32)
    if top_width == 0:
        return TokenScores(lp)
    return TokenScores(lp, torch.full((n, top_width), float("nan"), dtype=torch.float32),
                       torch.zeros((n, top_width), dtype=torch.int32))


def _widen(s: TokenScores, width: int) -> TokenScores:
    """The same scores with top-k columns padded (NaN) to ``width``."""
    have = s.top_width()
    if have >= width:
        return s
    pad = unknown_scores(len(s), width - have)
    if s.top_values is None or s.top_ids is None or pad.top_values is None or pad.top_ids is None:
        return TokenScores(s.logprobs, pad.top_values, pad.top_ids)
    return TokenScores(s.logprobs, torch.cat([s.top_values, pad.top_values], dim=1),
                       torch.cat([s.top_ids, pad.top_ids], dim=1))


def merge_scores(old: TokenScores | None, new: TokenScores) -> TokenScores:
    """Known values win over unknown ones; a top-k row with more entries wins over one with fewer.
    Both describe the same tokens after the same prefix, so known values agree where both know."""
    if old is None:
        return TokenScores(new.logprobs.clone(),
                           None if new.top_values is None else new.top_values.clone(),
                           None if new.top_ids is None else new.top_ids.clone())
    if len(old) != len(new):
        raise ValueError(f"scores of {len(old)} tokens merged with scores of {len(new)}")
    lp = torch.where(torch.isnan(old.logprobs), new.logprobs, old.logprobs)
    width = max(old.top_width(), new.top_width())
    if width == 0:
        return TokenScores(lp)
    a, b = _widen(old, width), _widen(new, width)
    take = (b.top_known() > a.top_known()).view(-1, 1)  # [n, 1] bool
    if a.top_values is None or a.top_ids is None or b.top_values is None or b.top_ids is None:
        raise RuntimeError("widened scores without top-k columns")
    return TokenScores(lp, torch.where(take, b.top_values, a.top_values), torch.where(take, b.top_ids, a.top_ids))


def concat_scores(parts: list[TokenScores]) -> TokenScores:
    """Scores of consecutive spans, end to end (top-k padded to the widest)."""
    width = max((p.top_width() for p in parts), default=0)
    if not parts:
        return unknown_scores(0, width)
    if width == 0:
        return TokenScores(torch.cat([p.logprobs for p in parts]))
    wide = [_widen(p, width) for p in parts]
    return TokenScores(torch.cat([p.logprobs for p in wide]),
                       torch.cat([p.top_values for p in wide if p.top_values is not None]),
                       torch.cat([p.top_ids for p in wide if p.top_ids is not None]))
