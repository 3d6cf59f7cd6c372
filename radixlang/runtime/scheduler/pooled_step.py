"""An embedding server's step: which final hidden rows each request of a prefill batch pools, and
the embedding of each request whose last chunk ran.

A request pools the rows of ``req.pooled.positions`` (runtime/model_executor/pooling.py); a long prompt
prefilled in chunks adds each chunk's share to its running sum. The runner returns hidden states
instead of logits on such a server, for the rows asked, so nothing else of the step changes.
"""
from __future__ import annotations

import torch

from radixlang.runtime.model_executor.pooling import PoolingConfig
from radixlang.runtime.scheduler.batch import ScheduleBatch


def pooled_rows(batch: ScheduleBatch) -> tuple[list[int], list[range]]:
    """Token rows of the batch whose hidden states are pooled, and each request's span of them."""
    rows: list[int] = []
    spans: list[range] = []
    offset = 0
    for req, pre, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        if req.pooled is None:
            raise RuntimeError(f"request {req.rid} in an embedding batch is not an embedding request")
        wanted = req.pooled.positions
        first = len(rows)
        rows.extend(offset + p - pre for p in range(max(wanted.start, pre), min(wanted.stop, pre + ext)))
        spans.append(range(first, len(rows)))
        offset += ext
    return rows, spans


def add_pooled(batch: ScheduleBatch, hidden: torch.Tensor, spans: list[range], config: PoolingConfig) -> None:
    """hidden [len(rows), hidden_size]: pool each request's rows; a request whose last chunk ran gets
    its embedding."""
    for req, span, last_chunk in zip(batch.reqs, spans, batch.sample_mask):
        pooled = req.pooled
        if pooled is None:
            raise RuntimeError(f"request {req.rid} in an embedding batch is not an embedding request")
        if span:
            pooled.add(hidden[span.start:span.stop])
        if last_chunk:
            if pooled.total is None:
                raise RuntimeError(f"request {req.rid} finished its prefill without a pooled row")
            req.embedding = config.finish(pooled.total, req.prompt_len, pooled.dimensions)
