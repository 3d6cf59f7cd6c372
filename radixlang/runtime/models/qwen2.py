"""Qwen2 / Qwen2.5: the Llama decoder with q/k/v biases and per-layer sliding windows (``layer_types``)."""
from __future__ import annotations

from radixlang.runtime.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass  # the bias (model_type qwen2) and the windows are read from the config by llama.Attention
