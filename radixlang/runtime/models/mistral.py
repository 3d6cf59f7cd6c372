"""Mistral: the Llama decoder with ``sliding_window`` on every layer when the config sets it."""
from __future__ import annotations

from radixlang.runtime.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass  # the window is read from the config by llama.Attention (layers/attention_config.py)
