"""Which logit rows a step needs, and the logprobs owed from them that are not of a sampled token: the
prompt's (input logprobs) and those of jump-forwarded output tokens; the runner computes them
(sampling/step_sampler.py), and the scheduler records them here."""
from __future__ import annotations

from typing import NamedTuple

from radixlang.kernels.attention.base import ForwardMode
from radixlang.runtime.sampling.step_io import Logprobs, Scored, StepOutput, StepPlan
from radixlang.runtime.scheduler.batch import Req, ScheduleBatch


class LogitSpan(NamedTuple):
    """One request's rows among a step's logit rows."""
    first: int  # its first row (input logprob rows come first)
    last: int  # the next-token logits of its last token; drafts' rows end just before it
    first_pos: int  # the prompt position of its first input-logprob row
    owed_first: int  # its rows for jump-forwarded tokens' logprobs (req.logprob_owed) ...
    num_owed: int  # ... and how many


def logit_rows(batch: ScheduleBatch) -> tuple[list[int], list[LogitSpan]]:
    """Token rows whose logits we need, and each request's span of them.

    A request with speculative drafts scores its last ``len(drafts) + 1`` rows: they end its span."""
    rows: list[int] = []
    spans = []
    offset = 0
    drafts = batch.drafts or [[]] * len(batch.reqs)
    for req, pre, ext, d in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, drafts):
        first_idx = len(rows)
        first_pos = pre
        if batch.mode is ForwardMode.EXTEND and req.return_logprob:
            # input logprobs: logits at position p score token p + 1 (prompt positions only)
            start = max(req.input_logit_start, pre)
            end = min(pre + ext, req.prompt_len - 1)
            first_pos = start
            rows.extend(offset + (p - pre) for p in range(start, end))
        owed_first = len(rows)
        owed = _owed_positions(req.seq_len, req.logprob_owed, pre, pre + ext - len(d))
        rows.extend(offset + (p - pre) for p in owed)
        # the last token's next-token logits, after those of the pending token and each draft but the last
        rows.extend(range(offset + ext - 1 - len(d), offset + ext))
        spans.append(LogitSpan(first_idx, len(rows) - 1, first_pos, owed_first, len(owed)))
        offset += ext
    return rows, spans


def _owed_positions(seq_len: int, num_owed: int, start: int, end: int) -> range:
    """Positions in [start, end) whose logits score the last ``num_owed`` tokens of the sequence."""
    return range(max(seq_len - num_owed - 1, start), min(seq_len - 1, end))


def prompt_scored(batch: ScheduleBatch, spans: list[LogitSpan]) -> list[Scored | None]:
    """Per request, its prompt rows whose logprobs this step owes (an EXTEND of a logprob request), or None."""
    out: list[Scored | None] = [None] * len(batch.reqs)
    if batch.mode is not ForwardMode.EXTEND:
        return out
    for i, (req, span, pre, ext) in enumerate(zip(batch.reqs, spans, batch.prefix_lens, batch.extend_lens)):
        if not req.return_logprob:
            continue
        # its report so far, counting the unscored first entry that recording adds
        have = len(req.input_token_logprobs) or int(req.input_logprob_unscored_first)
        if have >= req.prompt_len - req.input_logprob_start:
            continue  # complete already (a retracted request being recomputed)
        n = max(0, min(pre + ext, req.prompt_len - 1) - span.first_pos)
        if n:
            targets = req.origin_input_ids[span.first_pos + 1:span.first_pos + 1 + n]
            out[i] = Scored(first=span.first, targets=targets, top_k=req.top_logprobs_num)
    return out


def owed_scored(batch: ScheduleBatch, spans: list[LogitSpan]) -> list[Scored | None]:
    """Per request, the rows scoring its jump-forwarded tokens whose KV this step computes, or None."""
    out: list[Scored | None] = []
    for req, span in zip(batch.reqs, spans):
        first_tok = req.seq_len - req.logprob_owed  # position of the first owed token
        out.append(Scored(first=span.owed_first, targets=req.tokens(first_tok, first_tok + span.num_owed),
                          top_k=req.top_logprobs_num) if span.num_owed else None)
    return out


def record_input_logprobs(batch: ScheduleBatch, plan: StepPlan, out: StepOutput) -> None:
    if batch.mode is not ForwardMode.EXTEND:
        return
    for req, rp, ro in zip(batch.reqs, plan.reqs, out.reqs):
        if not req.return_logprob:
            continue
        if not req.input_token_logprobs and req.input_logprob_unscored_first:
            req.input_token_logprobs.append([None, req.origin_input_ids[req.input_logprob_start]])
            if req.top_logprobs_num:
                req.input_top_logprobs.append(None)
        if rp.prompt is not None and ro.prompt is not None:
            _extend(req.input_token_logprobs, req.input_top_logprobs, rp.prompt.targets, ro.prompt)


def record_jump_logprobs(batch: ScheduleBatch, plan: StepPlan, out: StepOutput) -> None:
    """The output logprobs of jump-forwarded tokens whose KV this step computes: the model's own,
    unmasked (the grammar forced them, and its mask may admit only another spelling of the same text);
    a finish the jump reached applies once none is owed."""
    for req, rp, ro, sampled in zip(batch.reqs, plan.reqs, out.reqs, batch.sample_mask):
        if rp.owed is not None and ro.owed is not None:
            _extend(req.output_token_logprobs, req.output_top_logprobs, rp.owed.targets, ro.owed)
            req.logprob_owed -= len(rp.owed.targets)
        if sampled and req.finish_after_logprobs is not None and not req.logprob_owed and not req.finished:
            req.finished_reason, req.finish_after_logprobs = req.finish_after_logprobs, None


def finishes_on_owed(req: Req, span: LogitSpan) -> bool:
    """Whether ``record_jump_logprobs`` will end this sampling request this step (the finish its jump
    reached, once its owed logprobs are in): it then picks no token."""
    return (req.finish_after_logprobs is not None and not req.finished
            and req.logprob_owed - span.num_owed <= 0)


def _extend(values: list, tops: list, targets: list[int], scored: Logprobs) -> None:
    values.extend([v, t] for v, t in zip(scored.values, targets))
    if scored.top is not None:
        tops.extend(scored.top)
