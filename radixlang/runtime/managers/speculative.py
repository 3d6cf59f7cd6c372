"""N-gram speculative decoding (prompt lookup): draft tokens from the request's own tokens.

A running request whose sequence ends with an n-gram seen earlier in its prompt or output drafts the
tokens that followed that earlier occurrence (the latest one; the longest n in the configured window
first). The decode step then feeds the request's pending token and its drafts as one extend, scores
every position, and keeps the drafts the target model agrees with (``Scheduler._verify_drafts``):
greedy output is token-for-token what plain decoding gives, and sampled output keeps the target's
distribution (``sampling.sampler.verify_draft``). The KV slots of rejected drafts go back to the pool
in the same step.

Requests that want output logprobs, have more than one pending token (after a jump-forward), or have
no room left (max_new_tokens, the context, the KV pool) decode without drafts.
"""
from __future__ import annotations

from radixlang.runtime.managers.schedule_batch import Req


class NgramIndex:
    """For each n in [min_n, max_n]: the latest start of every n-gram of a sequence that has a next token.

    Grows with the sequence: ``update`` indexes only the n-grams completed since the last call, so a
    step costs O(new tokens), not O(sequence).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = list(range(max_n, min_n - 1, -1))  # longest first
        self.starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed: dict[int, int] = dict.fromkeys(self.sizes, 0)  # starts indexed so far, per n

    def update(self, req: Req) -> None:
        length = req.seq_len
        for n in self.sizes:
            first, last = self.indexed[n], length - n  # start j has a next token iff j + n < length
            if last <= first:
                continue
            toks = req.tokens(first, length - 1)
            table = self.starts[n]
            for j in range(last - first):
                table[tuple(toks[j:j + n])] = first + j
            self.indexed[n] = last

    def draft(self, req: Req, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's suffix."""
        length = req.seq_len
        for n in self.sizes:
            if length <= n:
                continue
            j = self.starts[n].get(tuple(req.tokens(length - n, length)))
            if j is not None:
                return req.tokens(j + n, min(j + n + k, length))
        return []


class NgramDrafter:
    """Drafts for a decode batch; one NgramIndex per request, kept on the request."""

    def __init__(self, num_draft_tokens: int, min_n: int, max_n: int, context_len: int) -> None:
        self.k, self.min_n, self.max_n = num_draft_tokens, min_n, max_n
        self.context_len = context_len

    def drafts(self, reqs: list[Req], room: int) -> list[list[int]]:
        """Per request its drafts (maybe none), using at most ``room`` extra KV slots in all."""
        out: list[list[int]] = []
        for req in reqs:
            limit = self._limit(req)
            if limit <= 0 or room <= 0:
                out.append([])
                continue
            if req.draft_index is None:
                req.draft_index = NgramIndex(self.min_n, self.max_n)
            req.draft_index.update(req)
            d = req.draft_index.draft(req, min(limit, room))
            room -= len(d)
            out.append(d)
        return out

    def _limit(self, req: Req) -> int:
        if req.return_logprob or req.seq_len - req.kv_len != 1:
            return 0
        # the verified step appends up to len(drafts) + 1 tokens: stay within max_new_tokens and the context
        left = req.sampling_params.max_new_tokens - len(req.output_ids) - 1
        return min(self.k, left, self.context_len - req.seq_len - 1)
