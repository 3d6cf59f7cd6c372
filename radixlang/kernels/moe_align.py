"""The expert-sorted, block-padded layout of a routing's (token, expert) pairs (see kernels/fused_moe.py),
built with static-shape torch ops and no host reads, so that it can be built inside a captured CUDA graph.
Torch only: both the torch side and the Triton grouped GEMM (kernels/triton_ops/fused_moe.py) read it."""
from __future__ import annotations

from typing import NamedTuple

import torch


class ExpertBlocks(NamedTuple):
    """The pairs of a routing sorted by expert in blocks of ``block_m`` rows of one expert each.

    ``sorted_pair_ids`` [rows] int32: pair indices (pair p is token p // top_k, choice p % top_k), grouped by
    expert, each expert's run padded with ``num_pairs`` (no pair) to a multiple of block_m;
    ``block_expert_ids`` [rows // block_m] int32: each block's expert (``num_experts`` past the rows in use);
    ``num_rows_used`` [1] int32: the rows of the blocks in use (a device value: the kernel reads it)."""
    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    num_rows_used: torch.Tensor
    num_pairs: int
    block_m: int


def padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows ``num_pairs`` pairs can take once each expert's run is padded to a multiple of
    ``block_m``: at most min(num_experts, num_pairs) experts have pairs, each padding at most block_m - 1
    rows; rounded up to whole blocks."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-worst // block_m) * block_m


def align_pairs_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """ids [n, top_k] int (each token's experts) -> the expert-sorted, block-padded layout (ExpertBlocks).

    Every op has a shape fixed by n, top_k, num_experts and block_m and none reads a value on the host,
    so the layout can be built inside a captured CUDA graph and is rebuilt from the new ids on replay."""
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    flat = ids.reshape(-1).long()  # [P]: pair p is token p // top_k
    num_pairs, device = flat.numel(), flat.device
    # counts by scatter_add_: torch.bincount sizes its output from the largest id, a host read on CUDA
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # [P] pairs grouped by expert, in pair order within an expert
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank  # each pair's row in the padded layout
    rows = padded_rows(num_pairs, num_experts, block_m)
    sorted_pair_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, rows, block_m, dtype=torch.long, device=device)
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return ExpertBlocks(sorted_pair_ids, block_expert_ids, padded_end[-1:].to(torch.int32), num_pairs, block_m)
