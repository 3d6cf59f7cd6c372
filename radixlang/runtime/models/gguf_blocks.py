"""A GGUF tensor's quantized blocks decoded into the layouts the quantized kernels read
(kernels/cpu/quant.py; the table of types is in models/gguf_quant.py): integer codes [rows, cols] and
float32 scales and offsets per group [rows, cols / group], and ``DecodedBlocks``, one tensor's decoded
arrays with the row and column slices tensor parallelism takes of them; ``QuantLinear``, a linear over one
such weight (a GGUF's blocks, or ``--quantization int4``'s codes: models/quant.py), the ``kernel`` their
weight methods give a ``Linear`` (whose ``lora`` slot adds any adapter's delta)."""
from __future__ import annotations

from typing import Iterable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixlang.kernels.cpu import quant as qk
from radixlang.runtime.models.layers.linear import KernelWeight

LAYOUTS = {"Q4_0": ("q4", 32), "Q4_1": ("q4", 32), "Q4_K": ("q4", 32), "Q8_0": ("q8", 32), "Q5_0": ("q8", 32),
           "Q5_1": ("q8", 32), "Q5_K": ("q8", 32),
           "Q6_K": ("q8", 16)}  # the layout and group each type is kept in (decode_tensor, to_quant_weight)
NATIVE_TYPES = tuple(LAYOUTS)

# up to this many rows the kernel (which decodes each weight group once per 4 rows) is used; past it the
# weight is dequantized once for the call and the rows run through a float32 GEMM
KERNEL_MAX_ROWS = 16


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per 256-block."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _decode(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """raw uint8 [n_blocks, block_bytes] -> codes [n_blocks, weights], scales, offsets [n_blocks, groups], group."""
    n = raw.shape[0]
    if kind == "Q4_0":
        d, qs = _f16(raw[:, 0:2]), raw[:, 2:18]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        return q, d[:, None], (-8.0 * d)[:, None], 32
    if kind == "Q4_1":
        d, m, qs = _f16(raw[:, 0:2]), _f16(raw[:, 2:4]), raw[:, 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        return q, d[:, None], m[:, None], 32
    if kind in ("Q5_0", "Q5_1"):  # low nibbles as Q4_0's, plus bit j of the 32-bit qh as weight j's fifth bit
        d = _f16(raw[:, 0:2])
        start = 2 if kind == "Q5_0" else 4
        qh = raw[:, start:start + 4].copy().view("<u4")  # [n, 1]
        qs = raw[:, start + 4:start + 20]
        lo = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = (lo | (hi << 4)).astype(np.int8)
        if kind == "Q5_0":  # d * (q - 16): int8 codes of q - 16, no offset
            return q - 16, d[:, None], np.zeros((n, 1), np.float32), 32
        return q, d[:, None], _f16(raw[:, 2:4])[:, None], 32
    if kind == "Q8_0":
        d = _f16(raw[:, 0:2])
        return raw[:, 2:34].view(np.int8), d[:, None], np.zeros((n, 1), np.float32), 32
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(raw[:, 0:2]), _f16(raw[:, 2:4])
        sc, mn = _k_scale_min(raw[:, 4:16])
        scale, offset = d[:, None] * sc, -(dmin[:, None] * mn)
        if kind == "Q4_K":  # 4 chunks of 64 weights in 32 bytes: low nibbles the first 32, high the next
            qs = raw[:, 16:144].reshape(n, 4, 1, 32)
            q = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 256)
        else:  # the same low nibbles, plus a fifth bit per weight: bit j of qh[i] for sub-block j
            qh, qs = raw[:, 16:48], raw[:, 48:176]
            lo = ((qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
            hi = ((qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1)
            q = (lo | (hi << 4)).reshape(n, 256).astype(np.int8)
        return q, scale, offset, 32
    if kind == "Q6_K":
        ql, qh, sc, d = raw[:, 0:128], raw[:, 128:192], raw[:, 192:208].view(np.int8), _f16(raw[:, 208:210])
        lo = ((ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 2, 128)
        hi = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 2, 128)
        q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, 256)
        return q, d[:, None] * sc.astype(np.float32), np.zeros((n, 16), np.float32), 16
    raise ValueError(f"no native layout for GGUF type {kind}")


def block_bytes(kind: str) -> int:
    return {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]


def decode_tensor(kind: str, data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A GGUF tensor's raw bytes -> codes [rows, cols], scales / offsets [rows, cols / group], group."""
    per = 32 if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") else 256
    if cols % per:
        raise ValueError(f"a {kind} tensor needs rows of a multiple of {per} weights, got {cols}")
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1, block_bytes(kind))
    if raw.shape[0] != rows * cols // per:
        raise ValueError(f"{kind} tensor of {raw.shape[0]} blocks does not hold [{rows}, {cols}]")
    q, scale, offset, group = _decode(kind, raw)
    return (q.reshape(rows, cols), np.ascontiguousarray(scale, np.float32).reshape(rows, cols // group),
            np.ascontiguousarray(offset, np.float32).reshape(rows, cols // group), group)


def to_quant_weight(kind: str, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, group: int, *,
                    layout: str | None = None) -> qk.QuantWeight:
    """``layout``: q4 or q8, else the type's own (LAYOUTS)."""
    rows, cols = q.shape
    if (layout or LAYOUTS[kind][0]) == "q4":  # our q4 order: byte i of a 32-group = weight i | weight i + 16 << 4
        g = q.astype(np.uint8).reshape(rows, cols // 32, 32)
        codes = torch.from_numpy(np.ascontiguousarray((g[..., :16] | (g[..., 16:] << 4)).reshape(rows, cols // 2)))
        layout = "q4"
    else:
        codes = torch.from_numpy(np.ascontiguousarray(q.astype(np.int8)))
        layout = "q8"
    return qk.QuantWeight(layout, codes, torch.from_numpy(scale.copy()), torch.from_numpy(offset.copy()),
                          group, rows, cols)


class DecodedBlocks(NamedTuple):
    """One GGUF tensor decoded: codes [rows, cols], scales / offsets [rows, cols / group]; kept in
    ``layout`` (None: its type's own, LAYOUTS)."""
    kind: str
    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    group: int
    layout: str | None = None

    @property
    def kept_as(self) -> tuple[str, int]:
        return (self.layout or LAYOUTS[self.kind][0], self.group)

    def in_layout(self, layout: str, group: int) -> DecodedBlocks:
        """The same weights kept in ``layout`` with groups of ``group`` (dividing this one's): lossless, since
        every code fits the wider layout (4-bit codes in int8) and a group's scale and offset repeat over its
        smaller groups. A fused projection of mixed types (llama.cpp's Q4_K_M: Q4_K q/k, Q6_K v) is served
        from one weight this way."""
        if self.group % group or (layout == "q4" and self.kept_as[0] != "q4"):
            raise ValueError(f"a {self.kind} tensor ({self.kept_as}) cannot be kept as {layout} groups of {group}")
        k = self.group // group
        return self._replace(scale=np.repeat(self.scale, k, axis=1), offset=np.repeat(self.offset, k, axis=1),
                             group=group, layout=layout)

    def rows(self, first: int, end: int) -> DecodedBlocks:
        return self._replace(q=self.q[first:end], scale=self.scale[first:end], offset=self.offset[first:end])

    def take_rows(self, index: np.ndarray) -> DecodedBlocks:
        """The rows at ``index``, in its order (a model's row permutation: DeepSeek's rope rows)."""
        return self._replace(q=self.q[index], scale=self.scale[index], offset=self.offset[index])

    def cols(self, first: int, end: int) -> DecodedBlocks:
        """Input features [first, end), both on group boundaries (whole groups: codes, scales, offsets)."""
        g = self.group
        if first % g or end % g:
            raise ValueError(f"input features [{first}, {end}) of a {self.kind} tensor cut its groups of {g}")
        return self._replace(q=self.q[:, first:end], scale=self.scale[:, first // g:end // g],
                             offset=self.offset[:, first // g:end // g])

    def padded(self, rows: int) -> DecodedBlocks:
        """Zero rows appended up to ``rows`` (code, scale and offset 0: a zero weight)."""
        extra = rows - self.q.shape[0]
        if extra <= 0:
            return self

        def pad(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, np.zeros((extra, a.shape[1]), a.dtype)])
        return self._replace(q=pad(self.q), scale=pad(self.scale), offset=pad(self.offset))

    def weight(self) -> qk.QuantWeight:
        return to_quant_weight(self.kind, np.ascontiguousarray(self.q), np.ascontiguousarray(self.scale),
                               np.ascontiguousarray(self.offset), self.group, layout=self.layout)


def stackable(kinds: Iterable[str]) -> bool:
    """Whether tensors of these native types can be stacked into one weight (``common_layout``): every group
    size divides the largest."""
    groups = [LAYOUTS[k][1] for k in kinds]
    return all(max(groups) % g == 0 for g in groups)


def common_layout(pieces: list[DecodedBlocks]) -> list[DecodedBlocks]:
    """Pieces stacked into one weight, all kept alike: as they are when they already are, else as q8 codes
    in the finest group among them (``DecodedBlocks.in_layout``)."""
    kept = {p.kept_as for p in pieces}
    if len(kept) == 1:
        return pieces
    group = min(g for _, g in kept)
    return [p.in_layout("q8", group) for p in pieces]


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W a QuantWeight; float32 in and out."""

    def __init__(self, weight: qk.QuantWeight, bias: torch.Tensor | None, source_type: str) -> None:
        super().__init__()
        self.weight_q = weight.interleave()  # the layout this CPU's kernels read fastest
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.source_type = source_type
        self.dense: nn.Module | None = None  # the float32 prefill copy: gguf_quant.add_prefill_copies_

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.source_type} as {self.weight_q.layout}"

    def dequantized_weight(self) -> torch.Tensor:
        return qk.dequantize(self.weight_q)

    def kernel_weight(self) -> KernelWeight:
        """The weight as the fused decode step reads it (model_executor/decode_stack.py)."""
        return KernelWeight("quantized", self.weight_q, self.bias)

    def float32_weight(self) -> None:
        """No plain float32 weight is kept (layers/moe.py folds only those into its kernel)."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if x2.shape[0] <= KERNEL_MAX_ROWS:
            y = qk.linear(x2, self.weight_q, self.bias)
        elif self.dense is not None:
            y = self.dense(x2)
        else:
            y = F.linear(x2, qk.dequantize(self.weight_q), self.bias)
        return y.to(x.dtype).view(*lead, self.out_features)
