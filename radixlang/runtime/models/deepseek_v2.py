"""DeepSeek-V2: multi-head latent attention (layers/mla.py: the KV pool caches one compressed latent per
token and layer) and an MoE MLP with shared experts. The first ``first_k_dense_replace`` layers (and,
with ``moe_layer_freq``, the layers off that step) are dense; the others route with a softmax over the
experts, the top k (within the ``topk_group`` best of ``n_group`` groups when ``topk_method`` is
"group_limited_greedy"), weighted by the scores times ``routed_scaling_factor``, never renormalised
(as transformers' DeepseekV2, which leaves ``norm_topk_prob`` unused), plus ``n_shared_experts`` shared
experts as one dense MLP. The rotary features are interleaved pairs (see layers/mla.py).

Under tensor parallelism each rank holds its attention heads (layers/mla.py), every routed expert over
its slice of the expert intermediate features (layers/moe.py), and its slice of the shared experts and of
the dense layers' MLPs; the router and the latent projections are replicated.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixlang.runtime.models.layers.mla import MLAttention, deinterleave_rope_rows
from radixlang.runtime.models.layers.moe import Experts, MoEBlock, route_softmax_grouped
from radixlang.runtime.models.layers.rotary import rope_tables
from radixlang.runtime.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from radixlang.runtime.models.layers.weight_methods import PLAIN, WeightMethods
from radixlang.runtime.models.parallel import TPComm

_LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.")


def is_moe_layer(config: Any, layer_id: int) -> bool:
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    return (bool(getattr(config, "n_routed_experts", None)) and layer_id >= int(config.first_k_dense_replace or 0)
            and layer_id % freq == 0)


class Router(nn.Module):
    """The gate: logits in float32 (transformers keeps the gate in float32), and for V3 the selection bias."""

    def __init__(self, num_experts: int, hidden: int, *, selection_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if selection_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())  # [n, E]


class DeepseekMoE(MoEBlock):
    sigmoid_routing = False  # V3

    def __init__(self, config: Any, tp: TPComm | None = None, methods: WeightMethods = PLAIN) -> None:
        """Under ``tp`` the router is replicated (every rank routes alike), each expert and the shared
        experts hold this rank's slice of their intermediate features, as a dense MLP does."""
        super().__init__()
        hidden, num_experts = config.hidden_size, config.n_routed_experts
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.gate = Router(num_experts, hidden, selection_bias=self.sigmoid_routing)
        act = MLP(config, intermediate_size=1)  # resolves the activation
        self.experts = Experts(num_experts, hidden, config.moe_intermediate_size, act.act,
                               act_is_silu=act.act_name == "silu", tp=tp)
        shared = int(getattr(config, "n_shared_experts", 0) or 0)
        self.shared_experts = (MLP(config, tp, intermediate_size=config.moe_intermediate_size * shared, methods=methods)
                               if shared else None)
        self.tp = tp
        self.fused = False  # the decoder layer's sliced path is for dense MLPs (see llama.DecoderLayer)
        self.shared_folded = False  # pack_experts_: the shared experts run inside the experts' kernel

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        grouped = getattr(c, "topk_method", "greedy") == "group_limited_greedy"
        return route_softmax_grouped(self.gate(x), self.top_k, n_group=c.n_group if grouped else None,
                                     topk_group=c.topk_group, scale=float(c.routed_scaling_factor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]. Under tensor parallelism the routed and shared experts' terms are
        summed in one all-reduce."""
        weights, ids = self.route(x)
        if self.shared_folded:  # into the experts' kernel (Experts.pack_), each part weighted 1
            return self.experts(x, *self.experts.with_shared(weights, ids))
        if self.shared_experts is None:
            return self.experts(x, weights, ids)
        out = self.experts(x, weights, ids, reduce=False) + self.shared_experts.partial_sum(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def pack_experts_(self) -> None:
        """Run the experts, and the shared experts where they fold in, on the compiled kernel (Experts.pack_)."""
        if self.experts.pack_(self.shared_experts):
            self.shared_experts, self.shared_folded = None, True


class DeepseekV2DecoderLayer(DecoderLayer):
    attention_cls = MLAttention
    moe_cls: type[DeepseekMoE] = DeepseekMoE

    def make_mlp(self, config: Any, layer_id: int, tp: TPComm | None, methods: WeightMethods) -> nn.Module:
        return (self.moe_cls(config, tp, methods) if is_moe_layer(config, layer_id)
                else MLP(config, tp, methods=methods))


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    layer_cls = DeepseekV2DecoderLayer
    rope_interleaved = True

    def __init__(self, config: Any, *, tp: TPComm | None = None, **kw: Any) -> None:
        quant = getattr(config, "quantization_config", None)
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
            raise ValueError(f"{type(self).__name__} checkpoints quantized with {method!r} are not supported; "
                             f"use a bf16 / fp16 / fp32 one")
        super().__init__(config, tp=tp, **kw)
        # the KV pool caches (latent_dim, value_dim) per token and layer: see layers/mla.py
        self.mla_latent = (config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank)

    def rope_tables(self, config: Any, max_pos: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
        return [rope_tables(config, config.qk_rope_head_dim, max_pos)], [0] * config.num_hidden_layers

    def use_cpu_kernels(self) -> bool:
        used = super().use_cpu_kernels()
        self.cpu_kernels = False  # the rotary kernel turns whole heads; MLA rotates the rope part in torch
        return used

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".self_attn.q_proj.", ".self_attn.q_b_proj.")

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not self.rope_interleaved:
            return tensor
        c = self.config
        if name.endswith(".self_attn.q_b_proj.weight"):
            block = c.qk_nope_head_dim + c.qk_rope_head_dim
            return deinterleave_rope_rows(tensor, block=block, offset=c.qk_nope_head_dim, rope=c.qk_rope_head_dim)
        if name.endswith((".self_attn.kv_a_proj_with_mqa.weight", ".self_attn.kv_a_proj_with_mqa.bias")):
            block = c.kv_lora_rank + c.qk_rope_head_dim
            return deinterleave_rope_rows(tensor, block=block, offset=c.kv_lora_rank, rope=c.qk_rope_head_dim)
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As Llama's, without the layers past num_hidden_layers (V3 checkpoints carry their multi-token
        prediction layer there, which transformers skips too)."""
        layers = self.config.num_hidden_layers

        def in_model(name: str) -> bool:
            m = _LAYER.match(name)
            return m is None or int(m[2]) < layers

        super().load_weights((name, t) for name, t in weights if in_model(name))
