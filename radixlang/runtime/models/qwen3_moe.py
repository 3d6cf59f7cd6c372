"""Qwen3-MoE: Qwen3's attention (q/k norms) with Qwen2-MoE's sparse layers, without a shared expert."""
from __future__ import annotations

from radixlang.runtime.models.qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM
from radixlang.runtime.models.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_cls = Qwen3Attention
    shared_expert = False


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
