"""Mixtral: the Mistral decoder with a sparse MoE block (softmax over the experts, top-k, the k weights
renormalised); the checkpoint names the block ``block_sparse_moe`` and the experts' tensors w1 / w3 / w2."""
from __future__ import annotations

from typing import Any

from torch import nn

from radixlang.runtime.models.layers.moe import SparseMoE
from radixlang.runtime.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from radixlang.runtime.models.layers.weight_methods import WeightMethods
from radixlang.runtime.models.parallel import TPComm


class MixtralDecoderLayer(DecoderLayer):
    def make_mlp(self, config: Any, layer_id: int, tp: TPComm | None, methods: WeightMethods) -> nn.Module:
        act = MLP(config, intermediate_size=1)  # only to resolve the activation the dense MLP would use
        return SparseMoE(config, num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                         inter=config.intermediate_size, renormalize=True, act=act.act,
                         act_is_silu=act.act_name == "silu", tp=tp, methods=methods)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")
