"""Weight-only int8 quantization for the CPU (``--quantization int8``).

Every linear layer of the decoder, and the logits projection (a separate int8
copy when the embeddings are tied), keeps its weight (layers/weight_methods.py: ``Int8Method``) as int8 with one
symmetric scale per output channel. The matmul runs in PyTorch's
``_weight_int8pack_mm`` with bfloat16 activations, which streams a quarter
of the fp32 weight bytes: batch-1 decode is bound by those bytes on a CPU.
Batches of many tokens (prefill) dequantize to bfloat16 instead.
Outputs come back in the model dtype. Lossy: logits move by about 1% of their
range, so greedy outputs can differ from fp32 after some tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# up to this many rows the int8 kernel wins; past it, dequantizing the weight to bfloat16 once per
# call and running a bfloat16 matmul is several times faster (measured on this CPU: 3x at 1,000 rows)
GEMV_MAX_ROWS = 32


class Int8WeightOnlyLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features = w.shape

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if x2.shape[0] <= GEMV_MAX_ROWS:  # decode: bound by weight bytes, read as int8
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:  # prefill: bound by compute; dequantize once for a bfloat16 (AMX) matmul
            y = F.linear(x2, self.qweight.to(torch.bfloat16) * self.scales[:, None])
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)


def int4_linear(weight: torch.Tensor, bias: torch.Tensor | None, group: int = 32) -> nn.Module:
    """``--quantization int4``: a float weight [out, in] in 4-bit codes per group of 32 input features with a
    float32 scale and minimum each (w ~ q * scale + min, q in 0..15, rounded to nearest), run by the same
    kernels as a GGUF's Q4_1 blocks (models/gguf_quant.QuantLinear). Lossy."""
    from radixlang.kernels.cpu import quant as qk
    from radixlang.runtime.models.gguf_blocks import QuantLinear

    w = weight.detach().float()
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs in_features divisible by {group}, got {k}")
    g = w.view(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    return QuantLinear(qk.QuantWeight("q4", codes, scale.contiguous(), lo.contiguous(), group, n, k), bias, "int4")
