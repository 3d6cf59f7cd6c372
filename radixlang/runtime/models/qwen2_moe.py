"""Qwen2-MoE / Qwen1.5-MoE: the Qwen2 decoder whose sparse layers (every ``decoder_sparse_step``-th,
not in ``mlp_only_layers``) run a softmax-top-k MoE (renormalised when ``norm_topk_prob``) plus a shared
expert scaled by sigmoid(shared_expert_gate(x))."""
from __future__ import annotations

from typing import Any

from torch import nn

from radixlang.runtime.models.layers.moe import SparseMoE
from radixlang.runtime.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from radixlang.runtime.models.layers.weight_methods import WeightMethods
from radixlang.runtime.models.parallel import TPComm


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_id + 1) % step == 0)


class Qwen2MoeDecoderLayer(DecoderLayer):
    shared_expert = True

    def make_mlp(self, config: Any, layer_id: int, tp: TPComm | None, methods: WeightMethods) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return MLP(config, tp, methods=methods)
        shared = None
        if self.shared_expert and getattr(config, "shared_expert_intermediate_size", 0):
            shared = MLP(config, tp, intermediate_size=config.shared_expert_intermediate_size, methods=methods)
        act = MLP(config, intermediate_size=1)  # resolves the activation
        return SparseMoE(config, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                         inter=config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                         act=act.act, act_is_silu=act.act_name == "silu", shared_expert=shared, tp=tp, methods=methods)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer
