"""The grouped GEMM of the fused mixture-of-experts layer (as in vLLM's and SGLang's fused_moe).

One program per (block of ``block_m`` expert-sorted rows, tile of ``BLOCK_N`` output features): it reads
its block's expert id and pair ids (kernels/moe_align.py ``align_pairs_by_expert``), gathers the pairs'
input rows, multiplies them by that expert's weight tile with ``tl.dot`` and writes the pairs' output
rows. The grid is fixed by the layout's static row bound, so the launch can be captured in a CUDA graph;
blocks past the rows in use (``num_rows_used``, read on the device) return at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlang.kernels.moe_align import ExpertBlocks
from radixlang.kernels.triton_ops.precision import dot_precision


@triton.jit
def _grouped_gemm_kernel(A, W, Out, Scale, sorted_pair_ids, block_expert_ids, num_rows_used,
                         num_pairs, N, K, a_row_div,
                         stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                         HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    if pid_m * BLOCK_M >= tl.load(num_rows_used):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids + offs_m).to(tl.int64)  # [M]; num_pairs on padding rows
    mask_m = pair < num_pairs
    expert = tl.load(block_expert_ids + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + (pair // a_row_div)[:, None] * stride_am + offs_k[None, :] * stride_ak  # [M, K]
    w_ptrs = W + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if HAS_SCALE:
        acc = acc * tl.load(Scale + pair, mask=mask_m, other=0.0)[:, None]
    tl.store(Out + pair[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(Out.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _tiles(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): vLLM's default tiles, never wider than the matrix needs (tl.dot wants >= 16)."""
    return min(64, max(16, triton.next_power_of_2(n))), min(64, max(16, triton.next_power_of_2(k)))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks, *,
                 a_row_div: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[p] = a[p // a_row_div] @ w[expert(p)].T (times scale[p]) for every pair p of ``blocks``.

    a [*, K] (rows: tokens for the gate/up GEMM, a_row_div = top_k; pairs for the down GEMM, a_row_div = 1);
    w [E, N, K] (a row-major [N, K] per expert); out [P, N]; scale [P] float32 or None. Accumulates in
    float32; float32 inputs multiply in IEEE float32, not TF32."""
    n_out, k_in = w.shape[1], w.shape[2]
    if a.shape[-1] != k_in or out.shape != (blocks.num_pairs, n_out):
        raise ValueError(f"grouped_gemm: a {tuple(a.shape)}, w {tuple(w.shape)} and out {tuple(out.shape)} do not "
                         f"fit {blocks.num_pairs} pairs")
    if blocks.block_m < 16:
        raise ValueError(f"the triton grouped GEMM needs blocks of >= 16 rows (tl.dot), got {blocks.block_m}")
    if blocks.num_pairs == 0:
        return out
    block_n, block_k = _tiles(n_out, k_in)
    num_blocks = blocks.block_expert_ids.shape[0]
    grid = (num_blocks * triton.cdiv(n_out, block_n),)
    _grouped_gemm_kernel[grid](
        a, w, out, scale if scale is not None else out, blocks.sorted_pair_ids, blocks.block_expert_ids,
        blocks.num_rows_used, blocks.num_pairs, n_out, k_in, a_row_div,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        HAS_SCALE=scale is not None, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(a.dtype))
    return out
