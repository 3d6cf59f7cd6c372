"""Which logit rows a step needs, and the logprobs recorded from them that are not of a sampled
token: the prompt's (input logprobs) and those of jump-forwarded output tokens."""
from __future__ import annotations

from typing import NamedTuple

import torch

from radixlang.kernels.attention.base import ForwardMode
from radixlang.runtime.scheduler.batch import ScheduleBatch
from radixlang.runtime.sampling.sampler import compute_logprobs


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


def record_input_logprobs(batch: ScheduleBatch, logits: torch.Tensor, spans: list[LogitSpan]) -> None:
    if batch.mode is not ForwardMode.EXTEND:
        return
    for req, span, pre, ext in zip(batch.reqs, spans, batch.prefix_lens, batch.extend_lens):
        if not req.return_logprob:
            continue
        if not req.input_token_logprobs and req.input_logprob_unscored_first:
            req.input_token_logprobs.append([None, req.origin_input_ids[req.input_logprob_start]])
            if req.top_logprobs_num:
                req.input_top_logprobs.append(None)
        if len(req.input_token_logprobs) >= req.prompt_len - req.input_logprob_start:
            continue  # complete already (a retracted request being recomputed)
        n = max(0, min(pre + ext, req.prompt_len - 1) - span.first_pos)
        if n == 0:
            continue
        first_pos, first = span.first_pos, span.first
        targets = torch.tensor(req.origin_input_ids[first_pos + 1:first_pos + 1 + n], dtype=torch.int64)
        vals, top = compute_logprobs(logits[first:first + n], targets, req.top_logprobs_num)
        req.input_token_logprobs.extend([v, t] for v, t in zip(vals, targets.tolist()))
        if top is not None:
            req.input_top_logprobs.extend([list(p) for p in zip(vs, ids)] for vs, ids in zip(top.values, top.ids))


def record_jump_logprobs(batch: ScheduleBatch, logits: torch.Tensor, spans: list[LogitSpan]) -> None:
    """The output logprobs of jump-forwarded tokens whose KV this step computes: the model's own,
    unmasked (the grammar forced them, and its mask may admit only another spelling of the same text);
    a finish the jump reached applies once none is owed."""
    for req, span, sampled in zip(batch.reqs, spans, batch.sample_mask):
        if span.num_owed:
            n = span.num_owed
            first_tok = req.seq_len - req.logprob_owed  # position of the first owed token
            targets = torch.tensor(req.tokens(first_tok, first_tok + n), dtype=torch.int64)
            vals, top = compute_logprobs(logits[span.owed_first:span.owed_first + n], targets, req.top_logprobs_num)
            req.output_token_logprobs.extend([v, t] for v, t in zip(vals, targets.tolist()))
            if top is not None:
                req.output_top_logprobs.extend([list(p) for p in zip(vs, ids)] for vs, ids in zip(top.values, top.ids))
            req.logprob_owed -= n
        if sampled and req.finish_after_logprobs is not None and not req.logprob_owed and not req.finished:
            req.finished_reason, req.finish_after_logprobs = req.finish_after_logprobs, None
