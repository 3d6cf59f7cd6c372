"""KVSlots: the scheduler's per-request KV bookkeeping over the two pools and the ReqCache.

A request is admitted with a request slot and its cached prefix (locked), reserves KV slots
for the tokens it computes next, and gives them back on finish or retraction (what it computed
goes to the prefix cache unless it was aborted). Which requests run is the scheduler's choice;
this class only keeps the pools consistent.
"""
from __future__ import annotations

import torch

from radixlang.radix_cache.scores import TokenScores
from radixlang.runtime.scheduler.batch import Req
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.mem_cache.req_cache import ReqCache


class KVSlots:
    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool, cache: ReqCache) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.cache = cache

    def room(self) -> int:
        """Tokens that can get KV slots now or after evicting every unlocked cached slot (in both slot
        spaces of an swa pool)."""
        return self.cache.room()

    def extend_locs(self, reqs: list[Req], prefix_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
        """The KV slots a prefill batch writes: each request's reserved slots [prefix, prefix + extend),
        [sum(extend_lens)] int64."""
        rows = self.req_to_token_pool.req_to_token
        return torch.cat([rows[r.req_pool_idx, p:p + e].to(torch.int64)
                          for r, p, e in zip(reqs, prefix_lens, extend_lens)])

    def admit(self, req: Req) -> bool:
        """Give a waiting request a request slot and its cached prefix; False if no slot is free."""
        slots = self.req_to_token_pool.alloc(1)
        if slots is None:
            return False
        req.req_pool_idx = slots[0]
        req.swa_freed_len, req.swa_window_released = 0, False
        limit = req.seq_len - 1  # always compute at least one token: its logits are needed
        scores = None
        if req.return_logprob:
            limit, scores = self._scored_limit(req, limit)
        if req.pooled is not None:  # the cache keeps KV, not hidden states: pooled positions are computed
            limit = min(limit, req.pooled.positions.start)
        prefix, node = self.cache.match(req, limit)
        self.cache.lock(node)
        req.prefix_indices, req.last_node = prefix, node
        n = int(prefix.numel())
        if n:
            self.req_to_token_pool.req_to_token[req.req_pool_idx, :n] = prefix.to(torch.int32)
        req.kv_len = n
        if not req.is_retracted:
            req.cached_tokens = n
        if scores is not None and n > req.input_logit_start:
            _report_cached_logprobs(req, scores, n)
        return True

    def _scored_limit(self, req: Req, limit: int) -> tuple[int, TokenScores | None]:
        """How much cached prefix a prompt-logprob request may take, and the stored scores to report.

        Positions before ``input_logit_start`` need no logits; past it, a cached position p < limit can
        stand in for its logit row only when the tree keeps the score of token p + 1 (and a top-k as wide
        as asked), so the prefix ends one token after the last position whose next token is scored there
        and the logit row of its first uncached token is computed."""
        start = req.input_logit_start
        if req.input_token_logprobs or limit <= start:  # a retracted request has its report: plain limit
            return min(limit, start), None
        scores = self.cache.prefix_scores(req, limit)
        m = len(scores)
        known = ~torch.isnan(scores.logprobs[start + 1:m])
        if req.top_logprobs_num:
            known &= scores.top_known()[start + 1:m] >= req.top_logprobs_num
        gaps = torch.nonzero(~known)
        first_unknown = start + 1 + int(gaps[0]) if gaps.numel() else m
        return max(min(m, start), min(m - 1, first_unknown - 1)), scores

    def undo_admit(self, req: Req) -> None:
        """Take back an admission that reserved nothing (the request stays in the queue)."""
        if req.req_pool_idx is None or req.kv_len != int(req.prefix_indices.numel()):
            return  # not admitted, or it has computed tokens of its own: keep them
        if req.cached_input_logprobs:  # admission filled them from the cache: the next one does again
            req.input_token_logprobs, req.input_top_logprobs, req.cached_input_logprobs = [], [], 0
        self.cache.unlock(req)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.kv_len = None, None, 0
        req.prefix_indices = torch.empty(0, dtype=torch.int64)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` KV slots [n] int64, evicting cached ones if needed; None when even that is short."""
        self.cache.make_room(n)
        return self.kv_pool.alloc(n)

    def reserve_extend(self, req: Req, ext: int, *, headroom: int) -> bool:
        """Slots for the request's next ``ext`` tokens, leaving ``headroom`` slots (one decode token of
        every running request, so admission never starves decode); False if short."""
        if req.req_pool_idx is None:
            raise RuntimeError(f"request {req.rid} reserves KV before it was admitted")
        if self.room() < ext + headroom:
            return False
        loc = self.alloc(ext)
        if loc is None:
            return False
        self.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_len:req.kv_len + ext] = loc.to(torch.int32)
        req.kv_len += ext
        return True

    def reserve_pending(self, reqs: list[Req], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """Slots for every running request's tokens without KV (one, or more after a jump-forward), and
        after them for its speculative ``drafts``.

        Returns out_cache_loc [sum of pending and drafted] int64; the caller made room (``room()``) first.
        Only the pending tokens count in ``kv_len``: ``settle_drafts`` keeps the accepted drafts' slots.
        """
        pending = [r.seq_len - r.kv_len for r in reqs]
        extend_lens = [p + len(d) for p, d in zip(pending, drafts)] if drafts else pending
        prefix_lens = [r.kv_len for r in reqs]
        loc = self.alloc(sum(extend_lens))
        if loc is None:
            raise RuntimeError(f"no {sum(extend_lens)} KV slots for the decode batch after retraction "
                               f"({self.kv_pool.available_size()} free)")
        r2t = self.req_to_token_pool.req_to_token  # on the device: the indexed write's tensors go there too
        rows = torch.tensor([r.req_pool_idx for r, e in zip(reqs, extend_lens) for _ in range(e)], device=r2t.device)
        cols = torch.tensor([p + j for p, e in zip(prefix_lens, extend_lens) for j in range(e)], device=r2t.device)
        r2t[rows, cols] = loc.to(device=r2t.device, dtype=torch.int32)
        for r, e in zip(reqs, pending):
            r.kv_len += e
        return loc

    def settle_drafts(self, req: Req, drafted: int, accepted: int) -> None:
        """Keep the KV of the first ``accepted`` of the request's ``drafted`` tokens; free the others' slots."""
        if accepted < drafted:
            r2t = self.req_to_token_pool.req_to_token
            rejected = r2t[req.req_pool_idx, req.kv_len + accepted:req.kv_len + drafted]
            self.kv_pool.free(rejected.to(torch.int64))
        req.kv_len += accepted

    def trim_windows(self, reqs: list[Req]) -> None:
        """Free the window KV the requests' next queries cannot see (pools with an swa slot space)."""
        for req in reqs:
            self.cache.trim_window(req)

    def release(self, req: Req, *, keep: bool) -> None:
        """Free the request's slots; with ``keep`` its computed tokens first go to the prefix cache."""
        if req.req_pool_idx is None:
            return
        if keep:
            self.cache.cache_unfinished(req)
        self.cache.unlock(req)
        self.cache.release(req)


def _report_cached_logprobs(req: Req, scores: TokenScores, prefix_len: int) -> None:
    """Begin a fresh request's input logprob report with the stored scores of its cached positions
    (tokens input_logit_start + 1 .. prefix_len: the last one is the first uncached token, scored by
    the logit row of the last cached position); the extend computes the rest."""
    first = req.input_logit_start + 1
    ids = req.origin_input_ids
    if req.input_logprob_unscored_first:
        req.input_token_logprobs.append([None, ids[req.input_logprob_start]])
        if req.top_logprobs_num:
            req.input_top_logprobs.append(None)
    vals = scores.logprobs[first:prefix_len + 1].tolist()
    req.input_token_logprobs.extend([v, t] for v, t in zip(vals, ids[first:prefix_len + 1]))
    k = req.top_logprobs_num
    if k and scores.top_values is not None and scores.top_ids is not None:
        top_vals = scores.top_values[first:prefix_len + 1, :k].tolist()
        top_ids = scores.top_ids[first:prefix_len + 1, :k].tolist()
        req.input_top_logprobs.extend([[v, t] for v, t in zip(vs, ts)] for vs, ts in zip(top_vals, top_ids))
    req.cached_input_logprobs = len(req.input_token_logprobs)
