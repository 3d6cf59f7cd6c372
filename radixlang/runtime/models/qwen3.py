"""Qwen3: the Llama decoder with an RMSNorm over each head of q and k before the rotation (q_norm, k_norm)."""
from __future__ import annotations

from radixlang.runtime.models.llama import Attention, DecoderLayer, LlamaForCausalLM


class Qwen3Attention(Attention):
    qk_norm = True


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention
    fused_decode = True  # the fused decode step computes the q/k norms too


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
