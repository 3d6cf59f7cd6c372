"""A step's plan for the runner (sampling/step_io.py): per request of the batch, the logprobs owed from its
rows and how it picks its next token(s), with its grammar's bitmasks filled here, as vLLM's structured
output manager fills them for its runner."""
from __future__ import annotations

from radixlang.runtime.sampling.step_io import ReqPlan, StepPlan, TokenChoice
from radixlang.runtime.scheduler.batch import Req, ScheduleBatch
from radixlang.runtime.scheduler.grammar_step import grammar_rows
from radixlang.runtime.scheduler.input_logprobs import LogitSpan, finishes_on_owed, owed_scored, prompt_scored


def build_plan(batch: ScheduleBatch, spans: list[LogitSpan], *, vocab_size: int) -> StepPlan:
    """What the runner computes for ``batch`` from the logit rows ``spans`` name (input_logprobs.logit_rows).

    Without drafts, every request that samples this step chooses from its last row in one batched draw
    (unless none may take a token: max_new_tokens 0); with drafts, each request that is not ending
    verifies its drafts' rows, then chooses one more."""
    drafts = batch.drafts
    sampled = [i for i, s in enumerate(batch.sample_mask) if s]
    choose = drafts is not None or any(batch.reqs[i].max_new_tokens for i in sampled)
    plans = [ReqPlan(prompt=p, owed=o) for p, o in zip(prompt_scored(batch, spans), owed_scored(batch, spans))]
    for i in sampled if choose else []:
        req, span = batch.reqs[i], spans[i]
        ending = req.finished or finishes_on_owed(req, span)
        if drafts is not None and ending:
            continue  # a request ending this step verifies nothing
        d = drafts[i] if drafts is not None else []
        plans[i].choice = _choice(req, d, span.last - len(d), vocab_size, masked=not ending)
    return StepPlan(reqs=plans, verify=drafts is not None)


def _choice(req: Req, drafts: list[int], first: int, vocab_size: int, *, masked: bool) -> TokenChoice:
    """The request's token choice from rows ``first`` .. ``first + len(drafts)``; ``masked`` False: without
    its grammar's masks (a request ending this step, whose token is not kept)."""
    masks, accepting = None, [False] * (len(drafts) + 1)
    if req.grammar is not None and masked:
        masks, states = grammar_rows(req.grammar, drafts, vocab_size)
        accepting[:len(states)] = states
    elif req.grammar is not None:
        accepting[0] = req.grammar.is_accepting()
    p = req.sampling_params
    ends = sorted(req.eos_token_ids | set(p.stop_token_ids))
    # a grammar in an accepting state decides the end itself: banning EOS could leave no token
    blocked = [ends if len(req.output_ids) + j < p.min_new_tokens and not accepting[j] else []
               for j in range(len(drafts) + 1)]
    return TokenChoice(first=first, params=p, output_ids=req.output_ids, min_tokens_blocked=blocked,
                       drafts=list(drafts), masks=masks, logprobs=req.return_logprob,
                       top_k=req.top_logprobs_num, unmasked=req.return_logprob and req.grammar is not None)
