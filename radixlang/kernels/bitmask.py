"""Packed token bitmasks: allocate, fill, and apply to logits (torch on CPU, Triton on CUDA).

Layout: one int32 row per request, ``ceil(vocab_size / 32)`` words; bit ``i % 32``
of word ``i // 32`` set means token ``i`` is allowed. Applying a mask sets the
logits of disallowed tokens to -inf in place.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

_BLOCK = 1024


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch_size: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A bitmask allowing every token: [batch_size, ceil(vocab_size / 32)] int32."""
    if batch_size < 0 or vocab_size <= 0:
        raise ValueError(f"need batch_size >= 0 and vocab_size > 0, got {batch_size}, {vocab_size}")
    return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32, device=device)


def fill_full(bitmask: torch.Tensor) -> torch.Tensor:
    """Allow every token in every row (all bits set), in place."""
    return bitmask.fill_(-1)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[bs, words] int32 -> [bs, vocab_size] bool (True = allowed), vectorized."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [bs, words, 32] int32
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits and bitmask must be 2-D, got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask must have one row per logits row ({logits.shape[0]}), got {bitmask.shape[0]}")
    need = bitmask_words(logits.shape[1])
    if bitmask.shape[1] < need:
        raise ValueError(f"bitmask needs >= {need} words for vocab {logits.shape[1]}, got {bitmask.shape[1]}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask must be on the logits device {logits.device}, got {bitmask.device}")


def _as_index_tensor(indices: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(indices, dtype=torch.int64, device=device).reshape(-1)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor,
                                indices: Sequence[int] | torch.Tensor | None = None) -> None:
    """Set logits of disallowed tokens to -inf, in place.

    logits: [bs, vocab] float; bitmask: [bs, >= ceil(vocab / 32)] int32 on the same
    device; indices: the rows to mask (others untouched), all rows when None.
    CUDA tensors go through a Triton kernel, others through torch.
    """
    _check(logits, bitmask)
    if logits.is_cuda:
        apply_token_bitmask_inplace_triton(logits, bitmask, indices)
    else:
        apply_token_bitmask_inplace_torch(logits, bitmask, indices)


def apply_token_bitmask_inplace_torch(logits: torch.Tensor, bitmask: torch.Tensor,
                                      indices: Sequence[int] | torch.Tensor | None = None) -> None:
    vocab_size = logits.shape[1]
    if indices is None:
        allowed = unpack_bitmask(bitmask, vocab_size)  # [bs, vocab] bool
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = _as_index_tensor(indices, logits.device)
    if rows.numel() == 0:
        return
    allowed = unpack_bitmask(bitmask.index_select(0, rows), vocab_size)  # [n, vocab] bool
    sub = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


def apply_token_bitmask_inplace_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                                       indices: Sequence[int] | torch.Tensor | None = None) -> None:
    """The Triton path (also runs on CPU tensors under TRITON_INTERPRET=1)."""
    _check(logits, bitmask)
    kernel = _triton_kernel()
    vocab_size = logits.shape[1]
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous (stride 1 on the vocab dim)")
    if indices is None:
        rows = torch.zeros(1, dtype=torch.int64, device=logits.device)  # unused
        num_rows, has_indices = logits.shape[0], False
    else:
        rows = _as_index_tensor(indices, logits.device)
        num_rows, has_indices = rows.numel(), True
    if num_rows == 0:
        return
    grid = (num_rows, triton_cdiv(vocab_size, _BLOCK))
    kernel[grid](logits, bitmask, rows, vocab_size, logits.stride(0), bitmask.stride(0),
                 HAS_INDICES=has_indices, BLOCK=_BLOCK)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@functools.cache
def _triton_kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError("the CUDA bitmask kernel needs triton: pip install triton "
                          "(or pass CPU tensors to use the torch path)") from e

    @triton.jit
    def apply_bitmask_kernel(logits_ptr, bitmask_ptr, indices_ptr, vocab_size, logits_stride, bitmask_stride,
                             HAS_INDICES: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        block = tl.program_id(1)
        if HAS_INDICES:
            row = tl.load(indices_ptr + pid)
        else:
            row = pid
        offs = block * BLOCK + tl.arange(0, BLOCK)
        in_vocab = offs < vocab_size
        words = tl.load(bitmask_ptr + row * bitmask_stride + offs // 32, mask=in_vocab, other=-1)
        bits = (words >> (offs % 32)) & 1
        neg_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + row * logits_stride + offs, neg_inf, mask=in_vocab & (bits == 0))

    return apply_bitmask_kernel
