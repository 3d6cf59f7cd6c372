"""Gemma 2: (1 + w) RMSNorms around both sublayers (four per layer), embeddings scaled by sqrt(hidden),
GELU-tanh MLP, attention scaled by query_pre_attn_scalar and soft-capped, sliding windows on the layers
``layer_types`` marks, and soft-capped final logits. Gemma3 (gemma3.py) builds on this file."""
from __future__ import annotations

from typing import Any

import torch

from radixlang.runtime.models.layers.norm import RMSNorm, unit_offset_weight
from radixlang.runtime.models.layers.rotary import Rotary
from radixlang.runtime.models.llama import DecoderLayer, LlamaForCausalLM
from radixlang.runtime.models.layers.weight_methods import PLAIN, WeightMethods
from radixlang.runtime.models.parallel import TPComm


class Gemma2DecoderLayer(DecoderLayer):
    def __init__(self, config: Any, layer_id: int, tp: TPComm | None = None, methods: WeightMethods = PLAIN) -> None:
        super().__init__(config, layer_id, tp, methods)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rotary,
                forward_batch: Any, keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward: (normed MLP output, residual stream before it)."""
        x, residual = self.input_layernorm.add_norm(x, residual)
        x = self.self_attn.attend(x, rope, forward_batch)
        if keep_rows is not None:
            x, residual = x[keep_rows], residual[keep_rows]
        residual = residual + self.post_attention_layernorm(self.self_attn.o_proj(x))
        x = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(x), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma2DecoderLayer

    def __init__(self, config: Any, **kw: Any) -> None:
        self.embed_scale = float(config.hidden_size) ** 0.5
        super().__init__(config, **kw)

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return unit_offset_weight(tensor) if name.endswith("norm.weight") else tensor
