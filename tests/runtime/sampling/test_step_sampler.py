"""run_plan: a step's plan turned into token ids and logprobs on the runner, without a model."""
from __future__ import annotations

import math

import torch

from radixlang.kernels.bitmask import allocate_token_bitmask
from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.sampling.step_io import ReqPlan, Scored, StepPlan, TokenChoice
from radixlang.runtime.sampling.step_sampler import run_plan

VOCAB = 8
GREEDY = SamplingParams.from_dict({"temperature": 0.0})


def _only(*allowed: int) -> torch.Tensor:
    """A bitmask row allowing ``allowed`` alone: [words] int32."""
    mask = allocate_token_bitmask(1, VOCAB)[0].zero_()
    for t in allowed:
        mask[t // 32] |= 1 << (t % 32)
    return mask


def _rows(*favoured: int) -> torch.Tensor:
    """One logits row per favoured token: it leads by 5, token 7 second by 4."""
    logits = torch.zeros(len(favoured), VOCAB)
    for i, t in enumerate(favoured):
        logits[i, 7] = 4.0
        logits[i, t] = 5.0
    return logits


def _choice(first: int, drafts: list[int] = (), **kw) -> TokenChoice:
    return TokenChoice(first=first, params=kw.pop("params", GREEDY), output_ids=[],
                       min_tokens_blocked=kw.pop("blocked", [[]] * (len(drafts) + 1)), drafts=list(drafts), **kw)


def test_drafts_are_kept_while_the_chosen_token_equals_them_and_the_logits_are_left_unchanged():
    logits = _rows(3, 4, 6, 1)  # rows of one request: after its pending token, then after each draft
    before = logits.clone()
    plan = StepPlan(reqs=[ReqPlan(choice=_choice(0, [3, 4, 5]))], verify=True)
    out = run_plan(logits, plan, None)
    assert out.reqs[0].tokens == [3, 4, 6]  # draft 5 rejected at its row: the row's own token follows
    assert torch.equal(logits, before)


def test_a_draft_row_takes_its_own_mask_and_rows_stop_where_the_masks_do():
    logits = _rows(3, 4, 6, 1)
    # the grammar, advanced along the drafts, allows draft 0 at row 0 and rejects draft 1 (its row allows 7)
    masks = torch.stack([_only(3), _only(7)])
    plan = StepPlan(reqs=[ReqPlan(choice=_choice(0, [3, 4, 5], masks=masks))], verify=True)
    assert run_plan(logits, plan, None).reqs[0].tokens == [3, 7]
    # without the masks the same rows keep two drafts
    plan = StepPlan(reqs=[ReqPlan(choice=_choice(0, [3, 4, 5]))], verify=True)
    assert run_plan(logits, plan, None).reqs[0].tokens == [3, 4, 6]


def test_plain_greedy_and_banned_rows_in_one_verified_step():
    logits = _rows(2, 5, 0, 0)  # request a: rows 0-1 (one draft); request b: rows 2-3 (one draft)
    a = _choice(0, [2])
    b = _choice(2, [1], blocked=[[0], [0]])  # EOS (0) banned before min_new_tokens: 7 comes next
    assert a.plain_greedy and not b.plain_greedy
    out = run_plan(logits, StepPlan(reqs=[ReqPlan(choice=a), ReqPlan(choice=b)], verify=True), None)
    assert out.reqs[0].tokens == [2, 5] and out.reqs[1].tokens == [7]


def test_a_sampled_step_masks_then_scores_the_chosen_token_and_keeps_the_unmasked_row():
    logits = _rows(3, 5)
    choice = _choice(1, masks=_only(6, 7)[None], logprobs=True, top_k=2, unmasked=True)
    out = run_plan(logits, StepPlan(reqs=[ReqPlan(), ReqPlan(choice=choice)]), None).reqs
    assert out[0].tokens == [] and out[1].tokens == [7]
    value, top = out[1].token_logprob(0)
    assert math.isclose(value, -math.log1p(math.exp(-4.0)), rel_tol=1e-5)  # the masked row: 6 and 7 only
    assert [t for _, t in top] == [7, 6]
    raw = torch.log_softmax(logits[1], dim=-1)
    value, top = out[1].unmasked[0].logprob(5)  # a jump-forward respelled the token as 5
    assert math.isclose(value, float(raw[5]), rel_tol=1e-6) and [t for _, t in top] == [5, 7]


def test_owed_rows_are_scored_against_their_targets():
    logits = _rows(3, 5, 1)
    plan = StepPlan(reqs=[ReqPlan(prompt=Scored(first=0, targets=[3, 2], top_k=1), owed=Scored(first=2, targets=[1]))])
    out = run_plan(logits, plan, None).reqs[0]
    want = torch.log_softmax(logits, dim=-1)
    assert out.prompt is not None and out.owed is not None and out.owed.top is None
    assert torch.allclose(torch.tensor(out.prompt.values), torch.stack([want[0, 3], want[1, 2]]))
    assert [[t for _, t in row] for row in out.prompt.top] == [[3], [5]]  # each row's own top token
    assert torch.allclose(torch.tensor([row[0][0] for row in out.prompt.top]), torch.stack([want[0, 3], want[1, 5]]))
    assert math.isclose(out.owed.values[0], float(want[2, 1]), rel_tol=1e-6)
