"""N-gram drafting and the draft test of speculative decoding, without a model."""
from __future__ import annotations

import collections

import pytest
import torch

from radixlang.runtime.scheduler.batch import Req
from radixlang.runtime.scheduler.speculative import NgramDrafter, NgramIndex
from radixlang.runtime.sampling.sampler import SamplingInfo, verify_draft
from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.server_args import ServerArgs


def _req(prompt: list[int], output: list[int] = (), **params) -> Req:
    req = Req(rid="r", origin_input_ids=list(prompt), sampling_params=SamplingParams.from_dict(params),
              max_new_tokens=64)
    req.output_ids = list(output)
    req.kv_len = req.seq_len - 1
    return req


def test_drafts_follow_the_latest_earlier_match_longest_first():
    idx = NgramIndex(1, 3)
    # suffix [7, 8, 9] occurs once earlier (followed by 1, 2); [8, 9] also occurs later, followed by 5
    req = _req([7, 8, 9, 1, 2, 3, 8, 9, 5, 6, 7, 8, 9])
    idx.update(req)
    assert idx.draft(req, 3) == [1, 2, 3]  # the 3-gram wins over the later 2-gram match
    assert idx.draft(req, 10) == [1, 2, 3, 8, 9, 5, 6, 7, 8, 9]  # never past the sequence's end
    # the output grows: the index catches up incrementally and sees the output's own n-grams
    req.output_ids += [4, 4, 7, 8, 9]
    idx.update(req)
    assert idx.draft(req, 2) == [4, 4]
    assert idx.draft(_req([1, 2, 3]), 2) == []  # nothing indexed for this request: no draft


def test_no_draft_without_a_match_or_room():
    drafter = NgramDrafter(4, 1, 2, context_len=100)
    fresh = _req([1, 2, 3, 4])
    assert drafter.drafts([fresh], room=10) == [[]]
    rep = _req([1, 2, 3, 1, 2])
    assert drafter.drafts([rep], room=10) == [[3, 1, 2]]
    assert drafter.drafts([_req([1, 2, 3, 1, 2])], room=2) == [[3, 1]]  # the KV room bounds the drafts
    near_end = _req([1, 2, 3, 1, 2], output=[3] * 63)  # max_new_tokens 64: room for one more token only
    assert drafter.drafts([near_end], room=10) == [[]]
    two_left = _req([1, 2, 3, 1, 2], output=[3] * 62)  # one draft and the token after it
    assert drafter.drafts([two_left], room=10) == [[3]]
    logprobs = _req([1, 2, 3, 1, 2])
    logprobs.return_logprob = True
    assert drafter.drafts([logprobs], room=10) == [[]]


def test_speculative_flags_are_checked_at_start():
    with pytest.raises(ValueError, match="speculative_num_draft_tokens needs speculative_algorithm"):
        ServerArgs(speculative_num_draft_tokens=4)
    with pytest.raises(ValueError, match="speculative_draft_model_path needs speculative_algorithm"):
        ServerArgs(speculative_draft_model_path="m")
    with pytest.raises(ValueError, match="standalone needs speculative_draft_model_path"):
        ServerArgs(speculative_algorithm="standalone")
    with pytest.raises(ValueError, match="is for speculative_algorithm standalone"):
        ServerArgs(speculative_algorithm="ngram", speculative_draft_model_path="m")
    with pytest.raises(ValueError, match="speculative_algorithm must be one of"):
        ServerArgs(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match=">= 1"):
        ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="min <= max"):
        ServerArgs(speculative_algorithm="ngram", speculative_ngram_min_match_window_size=3,
                   speculative_ngram_max_match_window_size=2)


def test_greedy_draft_is_kept_only_when_it_is_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3, -1.0]])
    info = SamplingInfo(params=[SamplingParams.from_dict({"temperature": 0})], output_ids=[[]], min_tokens_blocked=[[]])
    assert verify_draft(logits.clone(), info, 1) == 1
    assert verify_draft(logits.clone(), info, 2) == 1
    assert verify_draft(logits.clone(), info, None) == 1


def _target(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """What sample() draws from, written out: softmax(l / T), top-k, then top-p over the sorted mass."""
    probs = torch.softmax(logits[0] / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept, mass = [], 0.0
    for rank, tok in enumerate(order):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        kept.append(tok)
        mass += probs[tok]
    total = sum(probs[t] for t in kept)
    return [probs[t] / total if t in kept else 0.0 for t in range(len(probs))]


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 3},
                                    {"temperature": 1.3, "top_p": 0.8}])
@pytest.mark.parametrize("draft", [0, 2, 5])
def test_sampled_tokens_keep_the_target_distribution(params, draft):
    # whatever the draft, the token verify_draft returns follows the distribution sample() draws from
    torch.manual_seed(0)
    logits = torch.randn(1, 6) * 1.5
    info = SamplingInfo(params=[SamplingParams.from_dict(params)], output_ids=[[]], min_tokens_blocked=[[]])
    gen = torch.Generator().manual_seed(1)
    n = 8000
    got = collections.Counter(verify_draft(logits.clone(), info, draft, gen) for _ in range(n))
    want = _target(logits, **params)
    for tok in range(6):
        assert abs(got[tok] / n - want[tok]) < 0.025, (tok, got, want)
        if want[tok] == 0.0:
            assert got[tok] == 0  # a token the filters drop never comes out, drafted or not


def test_a_constrained_request_verifies_its_drafts_under_the_grammar_advanced_along_them():
    """The plan carries one grammar mask per draft row; the scripted model favours other tokens, so a draft
    is kept only where its row's mask is the grammar's state after the drafts before it."""
    from scripted_runner import EOS, CharTokenizer, ScriptedRunner

    from radixlang.runtime.io_struct import TokenizedGenerateReq
    from radixlang.runtime.scheduler.scheduler import Scheduler

    runner = ScriptedRunner()
    sched = Scheduler(ServerArgs(device="cpu", dtype="float32", attention_backend="torch", num_threads=1,
                                 speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                                 disable_jump_forward=True), runner=runner)
    tok = CharTokenizer()
    sched.add_request(TokenizedGenerateReq(rid="r", input_ids=tok.encode("ababab"), sampling_params=SamplingParams
                                           .from_dict({"temperature": 0, "regex": "(ab){6}", "max_new_tokens": 13})))
    out: list[int] = []
    for _ in range(50):
        batch = sched.step()
        out += [t for row in (batch.rows if batch else []) for t in row.output_ids]
        if sched.is_idle():
            break
    assert tok.decode(out) == "ab" * 6 and out[-1] == EOS
    drafted = [rp.choice for plan in runner.plans if plan.verify for rp in plan.reqs
               if rp.choice is not None and rp.choice.drafts]
    assert max(len(c.drafts) for c in drafted) > 1  # rows after a draft were checked
    assert all(c.masks is not None and c.masks.shape[0] == len(c.drafts) + 1 for c in drafted)
    # every draft is the grammar's one allowed token there: kept only if its row had the advanced mask
    num_drafted = sum(len(c.drafts) for c in drafted)
    assert sched.stats["spec_draft_tokens"] == sched.stats["spec_accepted_tokens"] == num_drafted
    sched.check_memory_leak()
