"""Split-KV paged decode attention (one query token per request), grouped over the query heads of a KV head.

Stage 1 runs one program per (request, KV head, KV split) (a KV head with more than 16 query heads takes
one program per 16 of them): it streams that split's slots of the request
(``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, cut into ``num_kv_splits`` equal pieces) once for all the
query heads sharing the KV head, scores them with ``tl.dot`` ([heads, D] x [D, N]), keeps an online
softmax per head, and writes each head's normalized partial output and log-sum-exp (base 2). Reading
each KV row once per group, not once per query head, is what makes GQA decode (4 to 8 query heads a KV
head) cheap: SGLang's grouped decode kernel does the same. Stage 2 runs one program per (request, head)
and merges the splits. The grid depends only on the batch size and ``num_kv_splits``, never on sequence
lengths, so both stages can be captured in a CUDA graph; a split that falls past the end of a short
sequence writes lse = -inf and weight 0. Float32 inputs multiply in IEEE float32, not TF32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlang.kernels.triton_ops.precision import dot_precision

_LOG2E = 1.4426950408889634
_BLOCK_H = 16  # query heads per program: tl.dot's smallest tile; a group of more takes several programs


@triton.jit
def _decode_split_kernel(Q, K_buf, V_buf, kv_indptr, kv_indices, Mid_O, Mid_Lse,
                         sm_scale_log2, num_kv_splits,
                         stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                         GROUP: tl.constexpr, BLOCKS_PER_KV_HEAD: tl.constexpr, BLOCK_H: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head_block // BLOCKS_PER_KV_HEAD
    # the query heads of this KV head this program serves: up to BLOCK_H of its GROUP, padded to BLOCK_H
    # rows for tl.dot (which wants >= 16); padded rows read q = 0 and store nothing
    in_group = (head_block % BLOCKS_PER_KV_HEAD) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < GROUP
    heads = kv_head * GROUP + in_group  # [H]
    kv_start = tl.load(kv_indptr + b)
    seq_len = tl.load(kv_indptr + b + 1) - kv_start
    split_len = tl.cdiv(seq_len, num_kv_splits)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [H, D]

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)  # [N]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        # each K / V row is read once for the whole group of query heads
        k = tl.load(K_buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [H, N] f32
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [H, N]
        v = tl.load(V_buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    # an empty split (lo >= hi) stores 0 with lse -inf: weight 0 in stage 2
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = m_i + tl.log2(l_i)
    tl.store(Mid_O + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :], out,
             mask=mask_h[:, None] & mask_d[None, :])
    tl.store(Mid_Lse + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(Mid_O, Mid_Lse, O, num_kv_splits,
                         stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    # split 0 is never empty (seq_len >= 1), so m_i is finite from the first split on
    for split in range(0, num_kv_splits):
        lse = tl.load(Mid_Lse + b * stride_lb + h * stride_lh + split)
        o = tl.load(Mid_O + b * stride_mb + h * stride_mh + split * stride_ms + offs_d, mask=mask_d, other=0.0)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + w * o
        l_i = l_i * alpha + w
        m_i = m_new
    out = acc / l_i
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, mid_o: torch.Tensor,
                         mid_lse: torch.Tensor, *, num_kv_splits: int, sm_scale: float,
                         block_n: int = 32) -> torch.Tensor:
    """Paged decode attention into ``out``.

    q, out [bs, num_heads, head_dim]; k_buffer, v_buffer [pool_size, num_kv_heads, head_dim];
    kv_indptr [bs + 1] int32; kv_indices [total_kv] int32 (slots, page_size 1);
    mid_o [>= bs, num_heads, >= num_kv_splits, head_dim] fp32 and mid_lse
    [>= bs, num_heads, >= num_kv_splits] fp32 are scratch.
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads must be a multiple of num_kv_heads, got {num_heads} and {num_kv_heads}")
    if bs == 0:
        return out
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s head_dim axis must be contiguous, got stride {t.stride(-1)}")
    block_d = max(16, triton.next_power_of_2(head_dim))
    group = num_heads // num_kv_heads
    blocks_per_kv_head = triton.cdiv(group, _BLOCK_H)
    _decode_split_kernel[(bs, num_kv_heads * blocks_per_kv_head, num_kv_splits)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, mid_o, mid_lse,
        sm_scale * _LOG2E, num_kv_splits,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCKS_PER_KV_HEAD=blocks_per_kv_head, BLOCK_H=_BLOCK_H, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype))
    _decode_merge_kernel[(bs, num_heads)](
        mid_o, mid_lse, out, num_kv_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d)
    return out
