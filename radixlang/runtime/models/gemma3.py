"""Gemma 3 (text): Gemma 2's layer with (1 + w) q/k norms, no soft-capping by default, and a second
rotary table (another theta) for the sliding-window layers."""
from __future__ import annotations

from typing import Any

import torch

from radixlang.runtime.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from radixlang.runtime.models.layers.rotary import partial_rotary_factor, rope_tables
from radixlang.runtime.models.llama import Attention


class Gemma3Attention(Attention):
    qk_norm = True


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer

    def rope_tables(self, config: Any, max_pos: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
        """Table 0 for full-attention layers, table 1 for sliding ones."""
        rotary_dim = int(self.head_dim * partial_rotary_factor(config))
        kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        tables = [rope_tables(config, rotary_dim, max_pos, "full_attention"),
                  rope_tables(config, rotary_dim, max_pos, "sliding_attention")]
        return tables, [1 if k == "sliding_attention" else 0 for k in kinds]

    def rope_table_layer_type(self, table: int) -> str | None:
        return ("full_attention", "sliding_attention")[table]
