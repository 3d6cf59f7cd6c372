"""Speculative decoding's drafters: n-gram (prompt lookup) and a small draft model.

Each decode step, a drafter proposes a few tokens per running request; the scheduler feeds the
request's pending token and its drafts as one extend, and the runner scores every position and keeps
the drafts the target model agrees with (``sampling/step_sampler.py``): greedy output is token-for-token
what plain decoding gives, and sampled output keeps the target's distribution (``sampling.sampler.verify_draft``:
the drafts are deterministic, so rejection sampling against a one-hot proposal). The KV slots of
rejected drafts go back to the pool in the same step.

- ``NgramDrafter``: a request whose sequence ends with an n-gram seen earlier in its prompt or output
  drafts the tokens that followed that earlier occurrence (the latest one; the longest n first).
- ``DraftModelDrafter``: a second, smaller model with the same vocabulary, with its own KV pools,
  drafts greedily: one extend over the tokens it has not seen, then one decode per further draft.

Requests that want output logprobs, have more than one pending token (after a jump-forward), or have
no room left (max_new_tokens, the context, the KV pool) decode without drafts.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from radixlang.kernels.attention.base import ForwardMode
from radixlang.runtime.scheduler.batch import Req
from radixlang.runtime.model_executor.forward_batch import StepInputs
from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.sampling.step_io import ReqPlan, StepPlan, TokenChoice
from radixlang.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams.from_dict({"temperature": 0.0})  # the draft model's drafts are its argmax tokens


class Drafter(Protocol):
    def drafts(self, reqs: list[Req], room: int) -> list[list[int]]:
        """Per request its drafts (maybe none), using at most ``room`` extra target KV slots in all."""

    def settle(self, req: Req, drafted: int, accepted: int) -> None:
        """After the check: ``accepted`` of the request's ``drafted`` tokens were kept."""

    def release(self, req: Req) -> None:
        """The request finished or was retracted: drop what the drafter holds for it."""

    def find_leak(self) -> str | None:
        """With no request in flight: what the drafter still holds, or None."""


def draft_limit(req: Req, k: int, context_len: int) -> int:
    """How many tokens the request may draft this step."""
    if req.return_logprob or req.seq_len - req.kv_len != 1:
        return 0
    # the checked step appends up to len(drafts) + 1 tokens: stay within max_new_tokens and the context
    left = req.max_new_tokens - len(req.output_ids) - 1
    return min(k, left, context_len - req.seq_len - 1)


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
        out: list[list[int]] = []
        for req in reqs:
            limit = draft_limit(req, self.k, self.context_len)
            if limit <= 0 or room <= 0:
                out.append([])
                continue
            if req.draft_state is None:
                req.draft_state = NgramIndex(self.min_n, self.max_n)
            req.draft_state.update(req)
            d = req.draft_state.draft(req, min(limit, room))
            room -= len(d)
            out.append(d)
        return out

    def settle(self, req: Req, drafted: int, accepted: int) -> None:
        pass  # the index catches up with the sequence itself

    def release(self, req: Req) -> None:
        pass  # the index stays valid: the request's tokens are kept across a retraction

    def find_leak(self) -> str | None:
        return None


@dataclass
class _DraftSlot:
    """A request's row in the draft model's pools: KV slots are reserved for positions [0, reserved);
    the first ``kv_len`` hold the request's tokens, the next ``fed`` the drafts fed in the last step."""
    index: int
    kv_len: int = 0
    fed: int = 0
    reserved: int = 0


class DraftModelDrafter:
    """Greedy drafts from a second model (``--speculative-draft-model-path``) with its own KV pools.

    A step: one extend over each request's tokens the draft has no KV for (its whole prompt the first
    time, then the tokens the last check appended), whose last row gives draft 1; then one batched
    decode per further draft. After the check, the draft keeps the KV of the accepted drafts it fed.
    """

    def __init__(self, args: ServerArgs, num_draft_tokens: int, target_vocab: int, context_len: int) -> None:
        from radixlang.runtime.model_executor.model_runner import ModelRunner

        draft_args = dataclasses.replace(
            args, model_path=args.speculative_draft_model_path, tokenizer_path=None,
            load_format="dummy" if args.load_format == "dummy" else "auto",
            quantization=None, dtype="auto", speculative_algorithm=None, speculative_num_draft_tokens=None,
            speculative_draft_model_path=None, tp_size=1, nnodes=1, node_rank=0, dist_init_addr=None, dp_size=1,
            max_running_requests=args.max_running_requests, disable_cuda_graph=True,
            disable_hybrid_swa_memory=True).resolve()  # the drafter's KV bookkeeping never drops window KV
        self.runner = ModelRunner(draft_args)
        if self.runner.vocab_size != target_vocab:
            raise ValueError(f"the draft model {args.speculative_draft_model_path} has a vocabulary of "
                             f"{self.runner.vocab_size} tokens, the target {target_vocab}: they must be the same")
        self.k, self.context_len = num_draft_tokens, min(context_len, self.runner.context_len)
        self.req_pool, self.kv_pool = self.runner.req_to_token_pool, self.runner.kv_pool
        logger.info("speculative decoding: %d drafts a step from %s", self.k, args.speculative_draft_model_path)

    def drafts(self, reqs: list[Req], room: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        chosen: list[tuple[int, Req, _DraftSlot, int]] = []  # (batch index, req, slot, drafts wanted)
        for i, req in enumerate(reqs):
            want = min(draft_limit(req, self.k, self.context_len), room)
            if want <= 0:
                continue
            slot = self._slot(req, new_tokens=req.seq_len + want - 1)  # the last draft is never fed
            if slot is None:
                continue
            room -= want
            chosen.append((i, req, slot, want))
        if not chosen:
            return out
        # one extend: every token without draft KV, through the pending one; its last row is draft 1
        locs, input_ids, positions, pre, ext = [], [], [], [], []
        for _, req, slot, _ in chosen:
            n = req.seq_len - slot.kv_len
            input_ids += req.tokens(slot.kv_len, req.seq_len)
            positions += range(slot.kv_len, req.seq_len)
            locs.append(self._row(slot)[slot.kv_len:req.seq_len])
            pre.append(slot.kv_len)
            ext.append(n)
            slot.kv_len = req.seq_len
        rows = torch.tensor([sum(ext[:j + 1]) - 1 for j in range(len(ext))], dtype=torch.int64)
        last = self._greedy(StepInputs(
            mode=ForwardMode.EXTEND, input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64), req_pool_indices=self._indices(chosen),
            seq_lens=[p + e for p, e in zip(pre, ext)], prefix_lens=pre, extend_lens=ext,
            out_cache_loc=torch.cat(locs).to(torch.int64), logit_rows=rows,
            prompt_lens=[req.prompt_len for _, req, _, _ in chosen]))
        for (i, _, slot, _), tok in zip(chosen, last):
            out[i].append(tok)
            slot.fed = 0
        # then one decode per further draft, over the requests that want that many
        for step in range(1, max(w for *_, w in chosen)):
            group = [(i, req, slot, w) for i, req, slot, w in chosen if w > step]
            if not group:
                break
            seq = [req.seq_len + step for _, req, _, _ in group]
            loc = torch.stack([self._row(slot)[n - 1] for (_, _, slot, _), n in zip(group, seq)]).to(torch.int64)
            picked = self._greedy(StepInputs(
                mode=ForwardMode.DECODE, input_ids=torch.tensor([out[i][-1] for i, *_ in group], dtype=torch.int64),
                positions=torch.tensor([n - 1 for n in seq], dtype=torch.int64),
                req_pool_indices=self._indices(group), seq_lens=seq, prefix_lens=[n - 1 for n in seq],
                extend_lens=[1] * len(group), out_cache_loc=loc, logit_rows=torch.arange(len(group))))
            for (i, _, slot, _), tok in zip(group, picked):
                out[i].append(tok)
                slot.fed += 1
        return out

    def _greedy(self, inputs: StepInputs) -> list[int]:
        """Run the draft model; the argmax token of each logit row (the runner's sampling code)."""
        choice = [ReqPlan(choice=TokenChoice(first=i, params=_GREEDY, output_ids=[], min_tokens_blocked=[[]]))
                  for i in range(len(inputs.logit_rows))]
        return [out.tokens[0] for out in self.runner.execute(inputs, StepPlan(reqs=choice)).reqs]

    def settle(self, req: Req, drafted: int, accepted: int) -> None:
        slot = req.draft_state
        if not isinstance(slot, _DraftSlot) or drafted == 0:
            return
        # draft j has KV for j <= fed only; the rejected ones' slots and those reserved but never written go back
        keep = slot.kv_len + min(accepted, slot.fed)
        if slot.reserved > keep:
            self.kv_pool.free(self._row(slot)[keep:slot.reserved].to(torch.int64))
        slot.kv_len = slot.reserved = keep
        slot.fed = 0

    def release(self, req: Req) -> None:
        slot = req.draft_state
        if not isinstance(slot, _DraftSlot):
            return
        if slot.reserved:
            self.kv_pool.free(self._row(slot)[:slot.reserved].to(torch.int64))
        self.req_pool.free(slot.index)
        req.draft_state = None

    def find_leak(self) -> str | None:
        free, reqs_free = self.kv_pool.available_size(), self.req_pool.available_size()
        if free == self.kv_pool.size and reqs_free == self.req_pool.size:
            return None
        return (f"draft model memory leak: {free} of {self.kv_pool.size} KV slots and {reqs_free} of "
                f"{self.req_pool.size} request slots free")

    # ---- the draft's pools ----
    def _slot(self, req: Req, *, new_tokens: int) -> _DraftSlot | None:
        """The request's draft row with KV slots reserved for positions [0, ``new_tokens``)."""
        slot = req.draft_state
        if not isinstance(slot, _DraftSlot):
            index = self.req_pool.alloc(1)
            if index is None:
                return None
            slot = req.draft_state = _DraftSlot(index[0])
        need = new_tokens - slot.reserved
        if need > 0:
            loc = self.kv_pool.alloc(need)
            if loc is None:  # the draft's pool is full: this request goes without drafts, and frees its KV
                self.release(req)
                return None
            self._row(slot)[slot.reserved:new_tokens] = loc.to(torch.int32)
            slot.reserved = new_tokens
        return slot

    def _row(self, slot: _DraftSlot) -> torch.Tensor:
        return self.req_pool.req_to_token[slot.index]

    @staticmethod
    def _indices(chosen: list) -> torch.Tensor:
        return torch.tensor([slot.index for _, _, slot, _ in chosen], dtype=torch.int64)


def make_drafter(args: ServerArgs, *, vocab_size: int, context_len: int) -> Drafter | None:
    k = args.speculative_num_draft_tokens or 4
    if args.speculative_algorithm == "ngram":
        return NgramDrafter(k, args.speculative_ngram_min_match_window_size,
                            args.speculative_ngram_max_match_window_size, context_len)
    if args.speculative_algorithm == "standalone":
        return DraftModelDrafter(args, k, vocab_size, context_len)
    return None
