"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder; the checkpoint already holds q/k/v fused as
``qkv_proj`` and gate/up as ``gate_up_proj`` (our own layout, so they load as they are); longrope and
partial rotary come from the config (layers/rotary.py). Under tensor parallelism the fused tensors are
first cut back into q / k / v and gate / up, so that each part is sliced per rank as a Llama's is."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from radixlang.runtime.models.llama import LlamaForCausalLM, unfused_pieces


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights if self.tp is None else self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        heads = self.config.num_attention_heads
        kv_heads = getattr(self.config, "num_key_value_heads", None) or heads
        q, kv = heads * self.head_dim, kv_heads * self.head_dim  # the full model's, before the rank slice
        for name, tensor in weights:
            yield from unfused_pieces(name, tensor, q, kv) or [(name, tensor)]
