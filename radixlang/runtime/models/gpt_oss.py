"""GPT-OSS: attention with q/k/v/o biases, a learned sink logit per head (an extra softmax column that
takes probability mass and gives no value), sliding windows on alternate layers (``layer_types``),
yarn rotary; an MoE MLP routed top-k-then-softmax over biased router logits, whose experts hold
interleaved gate/up columns with biases and a clamped, offset SwiGLU: (clamp(up) + 1) *
g * sigmoid(1.702 g), g = min(gate, limit). Checkpoints in bf16 / fp32 (the MXFP4 release needs
dequantizing to one of those first)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixlang.runtime.models.layers.moe import dispatch, route_topk_softmax
from radixlang.runtime.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from radixlang.runtime.models.parallel import TPComm


class GptOssAttention(Attention):
    def __init__(self, config: Any, layer_id: int, tp: TPComm | None = None) -> None:
        super().__init__(config, layer_id, tp)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))  # [num_heads] logits, read by the backend


class GptOssExperts(nn.Module):
    """Stacked experts in the checkpoint's layout: gate_up_proj [E, hidden, 2 * inter] (gate and up
    columns interleaved), down_proj [E, inter, hidden], each with a bias."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)

    def expert(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        """xs [count, hidden] -> [count, hidden] through expert e."""
        gate_up = torch.addmm(self.gate_up_proj_bias[e], xs, self.gate_up_proj[e])  # [count, 2 * inter]
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return torch.addmm(self.down_proj_bias[e], (up + 1) * gate * torch.sigmoid(gate * self.alpha),
                           self.down_proj[e])


class GptOssMoE(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config)
        self.fused = False  # no dense sliced path (see llama.DecoderLayer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]."""
        weights, ids = route_topk_softmax(self.router(x), self.top_k)
        return dispatch(x, weights, ids, self.experts.num_experts, self.experts.expert)


class GptOssDecoderLayer(DecoderLayer):
    attention_cls = GptOssAttention

    def make_mlp(self, config: Any, layer_id: int, tp: TPComm | None) -> nn.Module:
        return GptOssMoE(config)


class GptOssForCausalLM(LlamaForCausalLM):
    layer_cls = GptOssDecoderLayer

    def __init__(self, config: Any, *, tp: TPComm | None = None, **kw: Any) -> None:
        if tp is not None:
            raise ValueError(f"{type(self).__name__} does not run with tensor parallelism yet (tp_size must be 1)")
        if getattr(config, "quantization_config", None):
            raise ValueError("GPT-OSS checkpoints quantized to MXFP4 are not supported; use a bf16 / fp32 one")
        super().__init__(config, tp=tp, **kw)
