"""Weight-only int8 quantization for the CPU (``--quantization int8``).

Every linear layer of the decoder, and the logits projection (a separate int8
copy when the embeddings are tied), keeps its weight as int8 with one
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

from radixlang.runtime.models.loader.gguf_file import GGUFFile

QUANTIZATIONS = ("int8", "int4", "gguf")  # gguf: the GGUF file's own blocks (models/gguf_quant.py)
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

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        return cls(linear.weight, linear.bias)

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


def int4_linear(linear: nn.Module, group: int = 32) -> nn.Module:
    """``--quantization int4``: a float linear's weight in 4-bit codes per group of 32 input features with a
    float32 scale and minimum each (w ~ q * scale + min, q in 0..15, rounded to nearest), run by the same
    kernels as a GGUF's Q4_1 blocks (models/gguf_quant.QuantLinear). Lossy."""
    from radixlang.kernels.cpu import quant as qk
    from radixlang.runtime.models.gguf_quant import QuantLinear

    w = linear.weight.detach().float()
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs in_features divisible by {group}, got {k}")
    g = w.view(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    weight = qk.QuantWeight("q4", codes, scale.contiguous(), lo.contiguous(), group, n, k)
    return QuantLinear(weight, getattr(linear, "bias", None), "int4")


def _tied(model: nn.Module, make) -> nn.Module:
    """The quantized logits projection of tied embeddings (a linear over the embedding table)."""
    lin = nn.Linear(1, 1, bias=False)
    lin.weight = nn.Parameter(model.embed_tokens.weight.detach(), requires_grad=False)
    lin.in_features, lin.out_features = lin.weight.shape[1], lin.weight.shape[0]
    return make(lin)


def quantize_model_(model: nn.Module, method: str, device: str, *, gguf_file: GGUFFile | None = None,
                    prefill_copies: bool = False, prefill_copy_bytes: int | None = None) -> nn.Module:
    """Replace the model's linear layers (and its logits projection) in place. ``gguf``: with the
    quantized blocks of ``gguf_file``, the file the model was loaded from (its header read once per
    start: loader/model_loader.open_checkpoint); ``prefill_copies``: plus a packed float32 copy per
    layer for prefills, unless they would exceed ``prefill_copy_bytes`` (gguf_quant.add_prefill_copies_)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    if device != "cpu":
        raise ValueError(f"quantization {method!r} is implemented for the CPU only, got device {device!r}")
    if method == "gguf":
        from radixlang.runtime.models.gguf_quant import add_prefill_copies_, apply_gguf_quantization_
        if gguf_file is None:
            raise ValueError("quantization 'gguf' needs a .gguf model file, got a checkpoint of another format")
        apply_gguf_quantization_(model, gguf_file)
        if prefill_copies:
            add_prefill_copies_(model, max_bytes=prefill_copy_bytes)
        return model
    make = Int8WeightOnlyLinear.from_linear if method == "int8" else int4_linear
    # int4 groups 32 input features; torch's int8 matmul crashed (segfault) at 2+ rows on widths that are
    # not a multiple of 16 (8, 24, 40, 56 here): a linear with another width stays float
    fits = (lambda k: k % 16 == 0) if method == "int8" else (lambda k: k % 32 == 0)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and fits(child.in_features):
                setattr(module, child_name, make(child))
    if getattr(model, "lm_head", "absent") is None and fits(model.embed_tokens.weight.shape[1]):
        model.lm_head = _tied(model, make)  # tied embeddings: the logits get their own quantized copy
    return model
