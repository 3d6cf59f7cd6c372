"""Which logit rows a step needs, and the prompt (input) logprobs recorded from them."""
from __future__ import annotations

import torch

from radixlang.kernels.attention.base import ForwardMode
from radixlang.runtime.managers.schedule_batch import ScheduleBatch
from radixlang.runtime.sampling.sampler import compute_logprobs


def logit_rows(batch: ScheduleBatch) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Token rows whose logits we need, and per request (first_row_idx, last_row_idx, first_pos).

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
            start = max(req.input_logprob_start, pre)
            end = min(pre + ext, req.prompt_len - 1)
            first_pos = start
            rows.extend(offset + (p - pre) for p in range(start, end))
        # the last token's next-token logits, after those of the pending token and each draft but the last
        rows.extend(range(offset + ext - 1 - len(d), offset + ext))
        spans.append((first_idx, len(rows) - 1, first_pos))
        offset += ext
    return rows, spans


def record_input_logprobs(batch: ScheduleBatch, logits: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
    if batch.mode is not ForwardMode.EXTEND:
        return
    for req, (first, last, first_pos), pre, ext in zip(batch.reqs, spans, batch.prefix_lens, batch.extend_lens):
        if not req.return_logprob:
            continue
        if not req.input_token_logprobs:
            start = req.input_logprob_start
            req.input_token_logprobs.append([None, req.origin_input_ids[start]])
            if req.top_logprobs_num:
                req.input_top_logprobs.append(None)
        if len(req.input_token_logprobs) >= req.prompt_len - req.input_logprob_start:
            continue  # complete already (a retracted request being recomputed)
        n = max(0, min(pre + ext, req.prompt_len - 1) - first_pos)
        if n == 0:
            continue
        targets = torch.tensor(req.origin_input_ids[first_pos + 1:first_pos + 1 + n], dtype=torch.int64)
        vals, top = compute_logprobs(logits[first:first + n], targets, req.top_logprobs_num)
        req.input_token_logprobs.extend([v, t] for v, t in zip(vals, targets.tolist()))
        if top is not None:
            req.input_top_logprobs.extend([list(p) for p in zip(vs, ids)] for vs, ids in zip(top.values, top.ids))
