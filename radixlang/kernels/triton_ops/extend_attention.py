"""Paged extend attention: new tokens attend to the cached prefix and causally to each other.

One program per (request, query head, block of BLOCK_M new tokens). It first
streams the request's cached prefix through the pool (slots
``prefix_kv_indices[prefix_kv_indptr[b]:prefix_kv_indptr[b+1]]``, all visible),
then the request's new tokens straight from the step's k/v tensors (rows
``qo_indptr[b]:qo_indptr[b+1]``, key j visible to query i iff j <= i), with one
online softmax over both parts. Prefill is the case of an empty prefix. Float32 inputs multiply in
IEEE float32, not TF32 (triton's default for float32 ``tl.dot``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlang.kernels.triton_ops.precision import dot_precision

_LOG2E = 1.4426950408889634


@triton.jit
def _online_block(q, k, v, s_mask, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION: tl.constexpr):
    # q [M, D], k/v [N, D], s_mask [M, N]; returns the updated (m_i, l_i, acc)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * sm_scale_log2  # [M, N]
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(Q, K_new, V_new, O, K_buf, V_buf, qo_indptr, prefix_kv_indptr, prefix_kv_indices,
                   sm_scale_log2,
                   stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh,
                   stride_kt, stride_kh, stride_vt, stride_vh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = h // GROUP
    q_start = tl.load(qo_indptr + b)
    extend_len = tl.load(qo_indptr + b + 1) - q_start
    if m_block * BLOCK_M >= extend_len:
        return
    prefix_start = tl.load(prefix_kv_indptr + b)
    prefix_len = tl.load(prefix_kv_indptr + b + 1) - prefix_start

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < extend_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    rows_m = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # cached prefix, read through the pool; every prefix token is visible
    for start in range(0, prefix_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        slots = tl.load(prefix_kv_indices + prefix_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(V_buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        m_i, l_i, acc = _online_block(q, k, v, mask_n[None, :], m_i, l_i, acc, sm_scale_log2, DOT_PRECISION)

    # the new tokens, causal; blocks past this query block's last row are all masked
    hi = tl.minimum(extend_len, (m_block + 1) * BLOCK_M)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < extend_len
        rows_n = (q_start + offs_n).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_new + rows_n[:, None] * stride_knt + kv_head * stride_knh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(V_new + rows_n[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        causal = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
        m_i, l_i, acc = _online_block(q, k, v, causal, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(O + rows_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


def extend_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         k_buffer: torch.Tensor, v_buffer: torch.Tensor, qo_indptr: torch.Tensor,
                         prefix_kv_indptr: torch.Tensor, prefix_kv_indices: torch.Tensor, *,
                         max_extend_len: int, sm_scale: float, block_m: int = 32,
                         block_n: int = 32) -> torch.Tensor:
    """Extend attention into ``out``.

    q, out [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim]
    (this step's new tokens, request by request); k_buffer, v_buffer
    [pool_size, num_kv_heads, head_dim]; qo_indptr, prefix_kv_indptr [bs + 1] int32;
    prefix_kv_indices [total_prefix] int32 (slots, page_size 1).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads must be a multiple of num_kv_heads, got {num_heads} and {num_kv_heads}")
    bs = qo_indptr.shape[0] - 1
    if bs == 0 or num_tokens == 0:
        return out
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s head_dim axis must be contiguous, got stride {t.stride(-1)}")
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (bs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k, v, out, k_buffer, v_buffer, qo_indptr, prefix_kv_indptr, prefix_kv_indices,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype))
    return out
