"""Mixture-of-experts dispatch for the device (CUDA) path, safe to capture in a CUDA graph.

A decode step that a CUDA graph captures must not read device values on the host (a sync inside a
capture fails it) and must not bake one step's routing into the graph: every shape has to follow from
the batch size alone. The (token, expert) pairs are therefore laid out as vLLM's and SGLang's
fused_moe lay them out: sorted by expert, each expert's run of pairs padded to a multiple of
``block_m`` rows, so that every block of ``block_m`` rows belongs to one expert. The number of rows
is bounded by a static worst case (``padded_rows``); blocks past the rows in use are launched and
return at once. A grouped GEMM (kernels/triton_ops/fused_moe.py) then runs one program per (block,
output tile) over its expert's weights: each expert's weights are read once per block, whatever the
routing.

This module is torch only: ``align_pairs_by_expert`` (kernels/moe_align.py) builds the layout with
static-shape ops (no ``bincount``, ``nonzero`` or ``.tolist()``), ``fused_experts`` runs the two GEMMs of
a gated MLP through a grouped GEMM, and ``grouped_gemm_reference`` is the torch oracle of the Triton
kernel (it gathers one weight matrix per row: tests and small models only).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from radixlang.kernels.moe_align import ExpertBlocks, align_pairs_by_expert


class GroupedGemm(Protocol):
    def __call__(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks, *,
                 a_row_div: int, scale: torch.Tensor | None = None) -> torch.Tensor: ...


def grouped_gemm_reference(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks, *,
                           a_row_div: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """What the Triton grouped GEMM computes, in torch with static shapes: out[p] = a[p // a_row_div] @
    w[expert(p)].T (times scale[p]) for every pair p. a [*, K]; w [E, N, K]; out [P, N]; scale [P] or None.
    Gathers one [N, K] weight per row (memory rows * N * K): an oracle for tests, not a serving path."""
    num_pairs = blocks.num_pairs
    pair = blocks.sorted_pair_ids.long()  # [rows]; num_pairs marks a padding row
    expert = blocks.block_expert_ids.long().repeat_interleave(blocks.block_m, output_size=pair.numel())
    expert = expert.clamp(max=w.shape[0] - 1)  # blocks past the rows in use: any expert, their rows are padding
    a_rows = a.index_select(0, (pair // a_row_div).clamp(max=a.shape[0] - 1))  # [rows, K]
    res = torch.bmm(w.index_select(0, expert).float(), a_rows.float()[:, :, None])[:, :, 0]  # [rows, N] f32
    if scale is not None:
        res = res * torch.cat([scale.reshape(-1).float(), scale.new_zeros(1, dtype=torch.float32)])[pair, None]
    landing = torch.zeros((num_pairs + 1, out.shape[1]), dtype=out.dtype, device=out.device)
    landing[pair] = res.to(out.dtype)  # padding rows all land in the extra last row
    out.copy_(landing[:num_pairs])
    return out


def device_grouped_gemm() -> GroupedGemm | None:
    """The Triton grouped GEMM, or None where triton is not installed (the caller then falls back)."""
    try:
        from radixlang.kernels.triton_ops.fused_moe import grouped_gemm
    except ImportError:
        return None
    return grouped_gemm


def default_block_m(num_tokens: int, num_experts: int) -> int:
    """vLLM's default: blocks of 16 rows while the tokens are no more than the experts (decode), else 64."""
    return 16 if num_tokens <= num_experts else 64


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  *, act_and_mul: Callable[[torch.Tensor], torch.Tensor], gemm: GroupedGemm,
                  block_m: int | None = None) -> torch.Tensor:
    """sum_j weights[:, j] * expert_{ids[:, j]}(x) through two grouped GEMMs, graph-safe.

    x [n, hidden]; w13 [E, 2 * inter, hidden] (gate rows, then up rows); w2 [E, hidden, inter];
    weights [n, k] float; ids [n, k] int; act_and_mul: [P, 2 * inter] -> [P, inter] (e.g. silu(gate) * up)
    -> [n, hidden] in x's dtype. The routing weight scales each pair's down projection in the kernel; the k
    choices of a token are summed in float32."""
    n, k = ids.shape
    num_experts = w13.shape[0]
    blocks = align_pairs_by_expert(ids, num_experts, block_m or default_block_m(n, num_experts))
    gate_up = torch.empty((n * k, w13.shape[1]), dtype=x.dtype, device=x.device)  # [P, 2 * inter], pair order
    gemm(x, w13, gate_up, blocks, a_row_div=k)
    hidden = act_and_mul(gate_up)  # [P, inter]
    down = torch.empty((n * k, w2.shape[1]), dtype=x.dtype, device=x.device)  # [P, hidden]
    gemm(hidden.contiguous(), w2, down, blocks, a_row_div=1, scale=weights.reshape(-1).float().contiguous())
    return down.view(n, k, -1).sum(1, dtype=torch.float32).to(x.dtype)
