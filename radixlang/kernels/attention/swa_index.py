"""Window layers' KV indices when the pool keeps them in a second slot space (``KVPoolLike.full_to_swa``).

``req_to_token`` and ``out_cache_loc`` name token (full) slots; a window layer's buffers are indexed by
swa slots. Once a step, the rows of the batch are translated into a compact table, so kernels that read
``req_to_token`` by request row read it for window layers unchanged. Tokens whose swa KV was freed map
to the dummy slot 0, outside every query's window.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from radixlang.kernels.attention.base import ForwardBatchLike


class SwaIndices(NamedTuple):
    req_to_token: torch.Tensor  # [bs, max_seq_len] int32: swa slots of the batch's rows, request i in row i
    req_pool_indices: torch.Tensor  # [bs] int64: arange(bs), the rows above
    out_cache_loc: torch.Tensor  # [num_tokens] int64: swa slots of the new tokens


def swa_indices(forward_batch: ForwardBatchLike) -> SwaIndices | None:
    """This step's window-layer indices, or None when the pool has one slot space."""
    full_to_swa = forward_batch.token_to_kv_pool.full_to_swa
    if full_to_swa is None:
        return None
    rows = forward_batch.req_to_token[forward_batch.req_pool_indices, :max(forward_batch.seq_lens_cpu)]
    table = full_to_swa[rows.to(torch.int64)].to(torch.int32)  # [bs, max_seq_len]
    idx = torch.arange(len(forward_batch.seq_lens_cpu), dtype=torch.int64, device=rows.device)
    return SwaIndices(table, idx, full_to_swa[forward_batch.out_cache_loc])
