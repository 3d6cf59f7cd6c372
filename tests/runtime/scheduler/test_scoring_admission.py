"""Admission of prompt-logprob requests over a radix tree holding stored scores (KVSlots): how much prefix
a request takes, which stored scores it reports, and that an undone admission reports nothing twice."""
from __future__ import annotations

import math

import pytest
import torch

from radixlang.radix_cache.scores import TokenScores
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.mem_cache.tree_req_cache import TreeReqCache
from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.scheduler.batch import Req
from radixlang.runtime.scheduler.kv_slots import KVSlots

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def _slots(scored: list[float | None]) -> KVSlots:
    """A pool whose tree caches PROMPT[:6] with these scores (None: unknown)."""
    r2t = ReqToTokenPool(4, 32, "cpu")
    kv = TokenToKVPool(64, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    cache = TreeReqCache(r2t, kv)
    slots = kv.alloc(6)
    cache.tree.insert(PROMPT[:6], slots)
    vals = torch.tensor([math.nan if v is None else v for v in scored], dtype=torch.float32)
    cache.tree.store_scores(PROMPT[:6], TokenScores(vals))
    return KVSlots(r2t, kv, cache)


def _req(start: int, top: int = 0) -> Req:
    return Req(rid="r", origin_input_ids=list(PROMPT), sampling_params=SamplingParams.from_dict({}),
               max_new_tokens=0, return_logprob=True, logprob_start_len=start, top_logprobs_num=top)


@pytest.mark.parametrize("scored,start,want_prefix,want_report", [
    # every cached token scored: back off one token, report tokens 1..5 from the tree
    ([None, -1.0, -2.0, -3.0, -4.0, -5.0], 0, 5, [None, -1.0, -2.0, -3.0, -4.0, -5.0]),
    # a gap at token 3: tokens 1..2 from the tree, the logits row of position 2 is computed
    ([None, -1.0, -2.0, None, -4.0, -5.0], 0, 2, [None, -1.0, -2.0]),
    # nothing scored: as before, no prefix past the first reported position's row
    ([None] * 6, 0, 0, []),
    ([None] * 6, 3, 2, []),
    # reporting from position 3 needs tokens 3..5 only
    ([None, None, None, -3.0, -4.0, -5.0], 3, 5, [-3.0, -4.0, -5.0]),
])
def test_prefix_taken_and_scores_reported(scored, start, want_prefix, want_report):
    kv = _slots(scored)
    req = _req(start)
    assert kv.admit(req)
    assert req.cached_tokens == want_prefix
    assert [v for v, _ in req.input_token_logprobs] == want_report
    assert [t for _, t in req.input_token_logprobs] == PROMPT[start:start + len(want_report)]
    assert req.cached_input_logprobs == len(want_report)


def test_top_k_narrower_than_asked_is_not_used_and_undo_clears_the_report():
    kv = _slots([None, -1.0, -2.0, -3.0, -4.0, -5.0])
    req = _req(0, top=2)
    assert kv.admit(req)
    assert req.cached_tokens == 0 and req.input_token_logprobs == []  # no stored top-k: recompute all
    kv.undo_admit(req)
    plain = _req(0)
    assert kv.admit(plain) and len(plain.input_token_logprobs) == 6
    kv.undo_admit(plain)  # it reserved nothing: the report the cache filled goes with the admission
    assert plain.input_token_logprobs == [] and plain.cached_input_logprobs == 0
    assert kv.admit(plain) and len(plain.input_token_logprobs) == 6  # filled once, not twice
