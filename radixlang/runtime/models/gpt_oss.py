"""GPT-OSS: attention with q/k/v/o biases, a learned sink logit per head (an extra softmax column that
takes probability mass and gives no value), sliding windows on alternate layers (``layer_types``),
yarn rotary; an MoE MLP routed top-k-then-softmax over biased router logits, whose experts hold
interleaved gate/up columns with biases and a clamped, offset SwiGLU: (clamp(up) + 1) *
g * sigmoid(1.702 g), g = min(gate, limit). Checkpoints in bf16 / fp32 (the MXFP4 release needs
dequantizing to one of those first).

Under tensor parallelism a rank holds its heads' sinks and every expert over its slice of the intermediate
features (a contiguous run of the interleaved gate/up columns, the matching down rows); the down bias is
added on rank 0 only, before the ranks' sum."""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from radixlang.runtime.models.layers.moe import dispatch, route_topk_softmax
from radixlang.runtime.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from radixlang.runtime.models.layers.linear import Linear
from radixlang.runtime.models.layers.weight_methods import PLAIN, WeightMethods
from radixlang.runtime.models.parallel import TPComm, shard_tensor, split_evenly


class GptOssAttention(Attention):
    def __init__(self, config: Any, layer_id: int, tp: TPComm | None = None, methods: WeightMethods = PLAIN) -> None:
        super().__init__(config, layer_id, tp, methods)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))  # [num_heads] logits, read by the backend


class GptOssExperts(nn.Module):
    """Stacked experts in the checkpoint's layout: gate_up_proj [E, hidden, 2 * inter] (gate and up
    columns interleaved), down_proj [E, inter, hidden], each with a bias."""

    def __init__(self, config: Any, tp: TPComm | None = None) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        if tp is not None:
            i = split_evenly(i, tp.size, "expert intermediate features")
        self.num_experts = e
        self.add_down_bias = tp is None or tp.rank == 0  # once, before the ranks' sum
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
        h = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        if self.add_down_bias:
            return torch.addmm(self.down_proj_bias[e], h, self.down_proj[e])
        return h @ self.down_proj[e]


class GptOssMoE(nn.Module):
    def __init__(self, config: Any, tp: TPComm | None = None, methods: WeightMethods = PLAIN) -> None:
        super().__init__()
        self.top_k, self.tp = config.num_experts_per_tok, tp
        self.router = Linear(config.hidden_size, config.num_local_experts, bias=True,  # replicated
                             method=methods.linear(config.hidden_size))
        self.experts = GptOssExperts(config, tp)
        self.fused = False  # no dense sliced path (see llama.DecoderLayer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]."""
        weights, ids = route_topk_softmax(self.router(x), self.top_k)
        out = dispatch(x, weights, ids, self.experts.num_experts, self.experts.expert)
        return out if self.tp is None else self.tp.all_reduce(out)


class GptOssDecoderLayer(DecoderLayer):
    attention_cls = GptOssAttention

    def make_mlp(self, config: Any, layer_id: int, tp: TPComm | None, methods: WeightMethods) -> nn.Module:
        return GptOssMoE(config, tp, methods)


class GptOssForCausalLM(LlamaForCausalLM):
    layer_cls = GptOssDecoderLayer

    def __init__(self, config: Any, *, tp: TPComm | None = None, **kw: Any) -> None:
        if getattr(config, "quantization_config", None):
            raise ValueError("GPT-OSS checkpoints quantized to MXFP4 are not supported; use a bf16 / fp32 one")
        super().__init__(config, tp=tp, **kw)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights if self.tp is None else self._rank_parts(weights))

    def _rank_parts(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's part of the tensors the Llama loader does not know how to slice."""
        assert self.tp is not None
        rank, size = self.tp.rank, self.tp.size
        dims = {"self_attn.sinks": 0, "experts.gate_up_proj": 2, "experts.gate_up_proj_bias": 1,
                "experts.down_proj": 1}  # experts.down_proj_bias: whole (added on rank 0)
        for name, tensor in weights:
            dim = next((d for suffix, d in dims.items() if name.endswith(suffix)), None)
            yield name, tensor if dim is None else shard_tensor(tensor, rank, size, dim=dim)
